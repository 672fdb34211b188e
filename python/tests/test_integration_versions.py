"""The integrations' supported-version ranges (issue 23), checked at patch / apply time with a
tested upper bound: transformers 5.24 to 5.x for switchyard.integrations.hf.patch (5.24 and 5.25
tested; a later 5.x minor passes, its routers checked class by class), megatron-core 0.16 to
0.19.x for switchyard.integrations.megatron.apply. The installed version is monkeypatched where
each integration reads it (transformers.__version__, megatron.core.package_info.__version__)."""
import sys
import warnings

import pytest

from hf_models import build

ALLOW = "SWITCHYARD_ALLOW_UNTESTED_VERSIONS"


# ---- transformers -------------------------------------------------------------------------------
@pytest.fixture
def hf(monkeypatch):
    pytest.importorskip("transformers")
    import switchyard.integrations.hf as syhf
    monkeypatch.delenv(ALLOW, raising=False)
    build("olmoe")  # transformers replaces its lazy module in sys.modules on the first model

    def with_version(v):
        monkeypatch.setattr(sys.modules["transformers"], "__version__", v)
        return syhf
    return with_version


@pytest.mark.hostile(tried="hf.patch under a transformers release of a newer major version "
                           "than the supported 5.24 to 5.x (6.0.0)",
                     gets="RuntimeError naming the installed version and the supported range, "
                          "before any router is touched (was: patched silently)")
def test_hf_patch_refuses_a_transformers_newer_than_the_supported_range(hf):
    syhf = hf("6.0.0")
    model = build("olmoe")
    with pytest.raises(RuntimeError, match=r"\[hf.patch\] transformers 6\.0\.0 is newer than the "
                                           r"supported 5\.24 to 5\.25\.x .*"
                                           r"SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1"):
        syhf.patch(model)
    assert syhf.patch_of(model) is None


@pytest.mark.hostile(tried="hf.patch under a transformers 5.x release newer than the tested ones "
                           "(5.26.0), no environment variable",
                     gets="patched without a warning (was: refused until "
                          "SWITCHYARD_ALLOW_UNTESTED_VERSIONS=1); a router class no spec covers "
                          "is refused by name")
def test_hf_a_later_5x_minor_is_patched_without_an_environment_variable(hf):
    syhf = hf("5.26.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = syhf.patch(build("olmoe"))
    assert p.active
    p.unpatch()


@pytest.mark.parametrize("version", ["5.12.0", "4.57.1", "5.23.9"])
def test_hf_patch_refuses_an_older_transformers(hf, version):
    with pytest.raises(RuntimeError, match=rf"\[hf.patch\] needs transformers 5\.24 to 5\.25\.x, "
                                           rf"found {version.replace('.', r'.')}"):
        hf(version).patch(build("olmoe"))


@pytest.mark.parametrize("version", ["5.24.0", "5.24.7", "5.25.0", "5.25.2"])
def test_hf_patch_takes_every_patch_release_of_the_supported_minors(hf, version):
    syhf = hf(version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = syhf.patch(build("olmoe"))
    assert p.active
    p.unpatch()


def test_hf_newer_transformers_passes_with_a_warning_under_the_env_var(hf, monkeypatch):
    syhf = hf("6.0.1")
    monkeypatch.setenv(ALLOW, "1")
    with pytest.warns(UserWarning, match=r"transformers 6\.0\.1 is newer than the supported 5\.24 "
                                         r"to 5\.25\.x.*patching anyway"):
        p = syhf.patch(build("olmoe"))
    assert p.active
    p.unpatch()
    # Never below the range, whatever the environment says.
    syhf = hf("5.20.0")
    with pytest.raises(RuntimeError, match=r"needs transformers 5\.24 to 5\.25\.x, found 5\.20\.0"):
        syhf.patch(build("olmoe"))


def test_hf_unreadable_version_is_named(hf):
    with pytest.raises(RuntimeError, match=r"cannot read the installed transformers version "
                                           r"'banana'; supported: transformers 5\.24 to 5\.25\.x"):
        hf("banana").patch(build("olmoe"))


# ---- megatron-core ------------------------------------------------------------------------------
@pytest.fixture
def mcore(monkeypatch):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core import package_info
    import switchyard.integrations.megatron as sym
    monkeypatch.delenv(ALLOW, raising=False)
    assert not sym.is_applied()

    def with_version(v):
        monkeypatch.setattr(package_info, "__version__", v)
        return sym
    yield with_version
    sym.remove()


@pytest.mark.hostile(tried="megatron.apply under a megatron-core newer than the supported "
                           "0.16 to 0.19.x (0.20.0)",
                     gets="RuntimeError naming the installed version and the supported range; "
                          "nothing patched (was: patched an untested release)")
def test_megatron_apply_refuses_a_megatron_core_newer_than_the_supported_range(mcore):
    sym = mcore("0.20.0")
    from megatron.core.transformer.moe.router import TopKRouter
    before = TopKRouter.__dict__["routing"]
    with pytest.raises(RuntimeError, match=r"\[megatron.apply\] megatron-core 0\.20\.0 is newer "
                                           r"than the supported 0\.16 to 0\.19\.x"):
        sym.apply()
    assert not sym.is_applied() and TopKRouter.__dict__["routing"] is before


def test_megatron_apply_refuses_an_older_megatron_core(mcore):
    with pytest.raises(RuntimeError, match=r"\[megatron.apply\] needs megatron-core 0\.16 to "
                                           r"0\.19\.x, found 0\.15\.3"):
        mcore("0.15.3").apply()


@pytest.mark.parametrize("version,tested", [("0.16.0", False), ("0.19.9", False),
                                            ("0.19.2", True)])
def test_megatron_apply_takes_the_supported_range(mcore, version, tested):
    report = mcore(version).apply()
    assert report.version == version and report.tested == tested


def test_megatron_newer_passes_with_a_warning_under_the_env_var(mcore, monkeypatch):
    sym = mcore("1.0.0")
    monkeypatch.setenv(ALLOW, "1")
    with pytest.warns(UserWarning, match=r"megatron-core 1\.0\.0 is newer than the supported "
                                         r"0\.16 to 0\.19\.x.*patching anyway"):
        report = sym.apply()
    assert sym.is_applied() and report.version == "1.0.0" and not report.tested
