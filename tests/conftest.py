import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
# The test models are tiny: one thread avoids thread start-up and oversubscription on 2-core CI.
torch.set_num_threads(1)
