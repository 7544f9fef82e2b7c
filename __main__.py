"""``python -m kiln`` runs the kiln CLI."""

from kiln.pipeline.cli import main

main()
