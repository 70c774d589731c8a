"""Inference: greedy and beam search, and the engines that translate text with them (PyTorch,
CTranslate2) behind one `Translator`."""
