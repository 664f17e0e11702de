"""Bank example: accounts as event-sourced streams on the ledger.

- `events`: the domain events and their registry,
- `account`: the Account aggregate (fold + decisions, no I/O),
- `bank`: the application service: no overdraw enforced at append time through expected
  versions, transfers as one atomic two-stream append with the transfer id as idempotency key,
- `invariant`: replay checks over plain ledger reads (sum of balances == deposits - withdrawals
  at every commit point, no negative balance, both legs of every transfer in one commit), and
  the balances view checked against them,
- `projections`: the balances and account-activity views (Projection API, fed from the
  ledger's ``bank.account`` topic), and the activity search index.
"""
