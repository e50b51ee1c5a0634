"""The site daemon: the launcher (torchrun) and the rank worker that composes core, layouts and edge."""
