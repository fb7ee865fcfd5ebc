"""`slothkit bench`: slothkit against Hugging Face + PEFT and its peers, side by side."""
