"""`python -m kappaflow.cli ...` is the same as `kappaflow ...`."""

from kappaflow.cli import main

main()
