"""``python -m kvxfer`` runs the command line."""

from kvxfer.cli import main_entry

if __name__ == "__main__":
    main_entry()
