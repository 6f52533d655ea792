"""docs/add-a-model.md's complete example runs: its Granite file, used as a custom module map,
matches transformers' GraniteForCausalLM (logits and 32 greedy tokens)."""
import pathlib
import re

import graphdsl as gd
from tests.models.hf_tiny import make_checkpoint
from tests.models.test_parity import check_parity

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "add-a-model.md"


def test_add_a_model_tutorial_file_matches_transformers(tmp_path):
    text = DOC.read_text()
    m = re.search(r"<!-- module_map: granite.py -->\n```python\n(.*?)```", text, re.S)
    assert m, "the tutorial's complete file is missing"
    module_map = tmp_path / "granite.py"
    module_map.write_text(m.group(1))
    hf_model = make_checkpoint("granite", tmp_path / "ckpt")
    llm = gd.LLM(tmp_path / "ckpt", device="cpu", max_model_len=96, custom_module_map=module_map)
    assert type(llm.model).__name__ == "GraniteForCausalLM" and llm.config.logits_scaling == 2.5
    check_parity(llm, hf_model)
