"""`python -m kvpush` runs the `kvpush` command: for hosts where the package is on the path
but not installed."""

from kvpush.cli import main

raise SystemExit(main())
