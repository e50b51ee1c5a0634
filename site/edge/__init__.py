"""The site's gRPC edge: the client, the gRPC link and the admission probe; the site core never imports it."""
