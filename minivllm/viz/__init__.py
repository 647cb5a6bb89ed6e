"""The old name of ``minivllm/learn/viz/`` (views of the engine's step records): ``from
minivllm.viz import ...`` gets the names ``minivllm.learn.viz`` exports."""
from minivllm.learn.viz import *  # noqa: F401,F403
from minivllm.learn.viz import __all__  # noqa: F401
