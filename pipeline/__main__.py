"""``python -m pipeline`` runs the kiln CLI."""

from pipeline.cli import main

main()
