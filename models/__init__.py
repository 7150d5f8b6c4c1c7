"""Model zoo: `models.get(name, config, **overrides)` -> Model with init/loss/batch/train_step."""

# Imported for their registration side effect.
from . import bert as bert  # noqa: E402
from . import candle_uno as candle_uno  # noqa: E402
from . import convnet_toy as convnet_toy  # noqa: E402
from . import dlrm as dlrm  # noqa: E402
from . import gpt as gpt  # noqa: E402
from . import gpt_gpu as gpt_gpu  # noqa: E402
from . import gpt_nnx as gpt_nnx  # noqa: E402
from . import mlp as mlp  # noqa: E402
from . import mmt as mmt  # noqa: E402
from . import moe as moe  # noqa: E402
from . import resnet as resnet  # noqa: E402
from . import t5 as t5  # noqa: E402
from . import wide_classifier as wide_classifier  # noqa: E402
from ._base import Model as Model
from ._registry import configs as configs
from ._registry import get as get
from ._registry import names as names
from ._registry import register as register
