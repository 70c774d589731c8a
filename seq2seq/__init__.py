"""seq2seq: train and use encoder-decoder Transformer translation models."""

__version__ = "0.1.0"
