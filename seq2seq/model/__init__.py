"""The model: the Transformer of "Attention Is All You Need", its layers and dropout, and its
interoperation with torch.nn.Transformer."""
