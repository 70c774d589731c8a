"""Data: read parallel text, encode it to token ids once, and cut it into token-budgeted batches."""
