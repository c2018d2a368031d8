import pytest

from tests.disagg.deployment_process import colocated

# Several page lengths (1 to 7 pages of 16 tokens), a chat prompt, and a stop string.
PROMPTS = [
    {"prompt": "The capital of France is", "max_tokens": 16},
    {"prompt": "Write a short poem about the sea and the wind. " * 4, "max_tokens": 16},
    {"prompt": "List three prime numbers: 2, 3,", "max_tokens": 12},
    {"messages": [{"role": "user", "content": "What is the boiling point of water in Celsius?"}],
     "max_tokens": 16},
    {"prompt": ("In a quiet village by the mountains there lived an old clockmaker who "
                "repaired every clock in the valley. ") * 4, "max_tokens": 16, "stop": ["."]},
]


@pytest.fixture(scope="session")
def colocated_reference(tmp_path_factory):
    return colocated(PROMPTS, tmp_path_factory.mktemp("colocated"))
