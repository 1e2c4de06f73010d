import os
import sys
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU); it is read when a
# kernel is defined, so it must be set before blockspec is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
# The test models are tiny: one thread avoids thread start-up and oversubscription on 2-core CI.
torch.set_num_threads(1)
