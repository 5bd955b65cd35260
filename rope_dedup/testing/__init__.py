"""Test models for users and this project's suite, as ``torch.testing`` is: a toy decoder in every RoPE layout."""
