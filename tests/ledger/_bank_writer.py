"""Subprocess for the kill -9 trials: transfers in a tight loop until killed.

Usage: python _bank_writer.py DSN SEED N_ACCOUNTS
Prints "attempt TID FROM TO AMOUNT" before each transfer and "ready" after the first success.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.bank.account import BankError
from examples.bank.bank import Bank
from examples.bank.events import registry
from kappaflow.ledger import Ledger


def main() -> None:
    dsn, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rnd = random.Random(seed)
    with Ledger(dsn, registry=registry, pool_size=1) as ledger:
        bank = Bank(ledger)
        ready = False
        i = 0
        while True:
            i += 1
            a, b = rnd.sample(range(n), 2)
            amount = rnd.randint(1, 60)
            tid = f"s{seed}-{i}"
            sys.stdout.write(f"attempt {tid} {a} {b} {amount}\n")
            sys.stdout.flush()
            try:
                bank.transfer(str(a), str(b), amount, transfer_id=tid)
            except BankError:
                continue
            if not ready:
                sys.stdout.write("ready\n")
                sys.stdout.flush()
                ready = True


if __name__ == "__main__":
    main()
