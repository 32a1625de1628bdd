import os
import sys

# ``harness`` (torchrun launcher shared by the distributed and end-to-end tiers).
sys.path.insert(0, os.path.dirname(__file__))
