"""What the READMEs say about the examples is what the examples do: the weight API the agentic
loop samples from, the same measured figures wherever they are quoted, and no converter flag
that has no effect in the scripts."""

import ast
import glob
import os
import re
import shlex

from helpers.torchrun import REPO_ROOT

LOOP = os.path.join(REPO_ROOT, "examples", "agentic_rl_loop.py")
README = os.path.join(REPO_ROOT, "README.md")
EXAMPLES_README = os.path.join(REPO_ROOT, "examples", "README.md")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _loop_texts():
    """The three places that describe the agentic loop: the README's paragraph, the examples
    README's table row, the script's docstring."""
    readme = _read(README)
    start = readme.index("`examples/agentic_rl_loop.py` closes the loop")
    paragraph = readme[start:readme.index("![reward curves]", start)]
    row = next(line for line in _read(EXAMPLES_README).splitlines() if line.startswith("| `agentic_rl_loop.py`"))
    return {"README.md": paragraph, "examples/README.md": row, "docstring": ast.get_docstring(ast.parse(_read(LOOP)))}


def test_the_texts_name_the_weight_api_the_loop_samples_from():
    api = re.search(r"sampler\.sync\(actor\.(\w+)\(\)\)", _read(LOOP)).group(1)
    for name, text in _loop_texts().items():
        assert f"{api}()" in text, name
        assert "state_dict_hf()" not in text.replace("iter_hf_weights", ""), name


def test_the_measured_figures_are_the_same_wherever_quoted():
    texts = _loop_texts()
    parted = {name: re.findall(r"through\s+iteration\s+(\d+)", text) for name, text in texts.items()}
    assert all(parted.values()) and len({n for found in parted.values() for n in found}) == 1, parted
    quoted = {name: text for name, text in texts.items() if name != "docstring"}
    for pattern in (r"iterations 1-(\d+)", r"(\d\.\d)-(\d\.\d)x", r"0\.54 -> (0\.\d+)", r"\((0\.0\d+)[;)\s]"):
        found = {name: re.findall(pattern, text) for name, text in quoted.items()}
        assert all(found.values()) and len({str(f) for v in found.values() for f in v}) == 1, (pattern, found)


def test_converter_parallel_flags_in_the_scripts_take_effect():
    # --tp / --pp shape only legacy output: with torch_dist (the default) they would do nothing.
    for script in glob.glob(os.path.join(REPO_ROOT, "examples", "*.sh")):
        for line in _read(script).replace("\\\n", " ").splitlines():  # continued lines joined
            if "convert_hf_checkpoint.py" not in line or line.lstrip().startswith("#"):
                continue
            words = shlex.split(line)
            if {"--tp", "--pp"} & set(words):
                assert "legacy" in words, f"{os.path.basename(script)}: {line.strip()}"
