"""The command line: the Typer commands, the error boundary they run in, and the demo."""
