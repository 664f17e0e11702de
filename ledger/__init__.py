"""The ledger: an append-only event store that feeds the log."""
