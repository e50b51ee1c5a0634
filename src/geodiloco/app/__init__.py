"""The application on top of every wing: the CLI, the demo, baselines, reports, status, export,
the WAN proxy."""
