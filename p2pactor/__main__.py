"""``python -m p2pactor`` runs the command line."""

from p2pactor.programs.cli import main

raise SystemExit(main())
