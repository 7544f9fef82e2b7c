"""The pipeline: config, stage graph and the kiln CLI."""
