"""Evaluation: scores exactly as sacrebleu computes them, and translate-then-score."""
