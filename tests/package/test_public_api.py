"""The top-level API: the names ``megatron_psrl`` exports lazily are listed by ``dir()`` (so
completion and introspection see them) and resolve."""

import pytest

import megatron_psrl


def test_dir_lists_the_lazy_api():
    listed = dir(megatron_psrl)
    assert "PolicyActor" in megatron_psrl.__all__
    missing = [name for name in megatron_psrl.__all__ if name not in listed]
    assert not missing, f"dir(megatron_psrl) misses {missing}"
    assert "__version__" in listed and "quiet_expected_import_warnings" in listed  # the plain globals too
    assert listed == sorted(listed)


def test_every_exported_name_resolves():
    for name in megatron_psrl.__all__:
        value = getattr(megatron_psrl, name)
        assert getattr(value, "__name__", name) == name, name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchThing"):
        megatron_psrl.NoSuchThing  # noqa: B018
