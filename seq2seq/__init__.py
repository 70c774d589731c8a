"""seq2seq: train and use encoder-decoder Transformer translation models.

`from seq2seq import Translator` is the Python API (inference/translator.py); it is imported on first use, so
`import seq2seq` stays cheap.
"""

__version__ = "0.2.0.dev0"  # the package's version, declared here alone (pyproject.toml reads it); CHANGELOG.md


def __getattr__(name: str):
    if name == "Translator":
        from seq2seq.inference.translator import Translator

        return Translator
    raise AttributeError(f"module 'seq2seq' has no attribute {name!r}")
