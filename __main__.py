"""``python -m kiln`` runs the kiln CLI."""

from kiln.pipeline.entry import main

main()
