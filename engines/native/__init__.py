"""The native builder: a Hugging Face checkpoint (plain or modelopt FP8 / INT4-AWQ) to a native engine directory."""
