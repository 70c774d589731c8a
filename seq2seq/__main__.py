"""`python -m seq2seq` (and `torchrun -m seq2seq`) run the CLI."""

from seq2seq.cli.main import main

main()
