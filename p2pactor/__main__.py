"""``python -m p2pactor`` runs the command line."""

from p2pactor.cli import main

raise SystemExit(main())
