"""The old name of ``minivllm/learn/exercises/`` (the classroom exercises' checks and grader):
``from minivllm.exercises import ...`` gets the names ``minivllm.learn.exercises`` exports."""
from minivllm.learn.exercises import *  # noqa: F401,F403
from minivllm.learn.exercises import __all__  # noqa: F401
