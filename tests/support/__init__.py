"""What several test tiers share, in one place: free ports, the shortened tiny recipe, TensorBoard read-back, small
Hugging Face models and tokenizers. Tests import from here, never from another tier's folder."""
