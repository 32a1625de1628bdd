"""HelixPipe: attention-parallel partition, two-fold first-in-last-out schedule."""
