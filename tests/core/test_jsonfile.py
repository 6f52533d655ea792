"""read_json_object: the one reader of config.json / tokenizer side files; errors name the file."""
import pytest

from graphdsl import GraphDSLError
from graphdsl.runtime.loaders.jsonfile import read_json_object


def test_reads_objects_and_names_bad_files(tmp_path):
    good = tmp_path / "config.json"
    good.write_text('{"model_type": "llama"}')
    assert read_json_object(good) == {"model_type": "llama"}
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(GraphDSLError, match=r"cannot read '.*broken.json'"):
        read_json_object(bad)
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    with pytest.raises(GraphDSLError, match=r"'.*list.json' must hold a JSON object, got list"):
        read_json_object(arr)
    with pytest.raises(GraphDSLError, match=r"cannot read '.*missing.json'"):
        read_json_object(tmp_path / "missing.json")
