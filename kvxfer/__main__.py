"""``python -m kvxfer`` runs the command line."""

from kvxfer.cli import main_entry

main_entry()
