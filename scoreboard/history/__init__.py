"""The sealed history, harness side only: receipts (schema and parsing), their seals, the hash-chained
ledger, the frontier slots it moves, the history held for a round, and `verify` over all of it.

Nothing here imports torch or runs candidate code; see docs/receipt-format.md and docs/layout.md.
"""
