"""What a non-editable install gets: the wheel carries the templates and the trained heads, and an installed
copy finds its templates without the source checkout (a user's `pip install .` once failed with "the novel
template is missing from this installation")."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_ships_the_templates_and_an_installed_copy_finds_them(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("swiftwrite", "kernels", "prompts"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    # build_meta directly: the same backend pip calls, without pip's isolated environment (no network here)
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-c", f"import setuptools.build_meta as b; b.build_wheel({str(out)!r})"],
                   cwd=src, check=True, capture_output=True)
    wheel = next(out.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in ("novel", "report", "structured", "revise"):
        assert f"swiftwrite/templates/{template}.txt" in names
    assert any(n.startswith("swiftwrite/heads/") and n.endswith(".safetensors") for n in names)
    assert "swiftwrite/models/models.yaml" in names
    assert "swiftwrite/kernels/tree_attention.py" in names and not any(n.startswith("kernels/") for n in names)

    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:  # a wheel is a zip laid out as site-packages: unpacking it installs it
        zf.extractall(site)
    # -I: no PYTHONPATH, no current directory on the path; the unpacked copy goes first, ahead of this
    # environment's own (editable) swiftwrite, and the probe checks which one it imported
    probe = (f"import sys; sys.path.insert(0, {str(site)!r}); import swiftwrite, swiftwrite.io.prompt as p; "
             "import swiftwrite.kernels.tree_attention as k; assert k.__file__.startswith(swiftwrite.__path__[0]); "
             "print(swiftwrite.__file__); print(p.apply_template('THE BRIEF', 'novel')); "
             "print(p.apply_template('THE BRIEF', 'report'))")
    r = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(str(site)), f"imported {lines[0]}, not the installed copy"
    assert r.stdout.count("THE BRIEF") == 2
    assert (ROOT / "prompts" / "novel.txt").read_text().split("{brief}")[0].strip() in r.stdout


def test_a_checkouts_kernels_do_not_shadow_hugging_faces_kernels_package(tmp_path):
    """transformers 5.25 requires and imports Hugging Face's `kernels` package (`from kernels import CUDAProperties`).
    Our kernels/ once was a top-level package of that name, and with a checkout's root on the path (`python -m`
    from it, the bench scripts) it shadowed theirs: every transformers model class failed to import. Now, with the
    root first on the path and a stand-in for theirs after it, `kernels` is theirs and ours is swiftwrite.kernels."""
    theirs = tmp_path / "site" / "kernels"
    theirs.mkdir(parents=True)
    (theirs / "__init__.py").write_text("CUDAProperties = 'theirs'\n")
    probe = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(tmp_path / 'site')!r}]; "
             "from kernels import CUDAProperties; import swiftwrite.kernels.tree_attention as k; "
             "print(CUDAProperties, k.MAX_NODES)")
    r = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["theirs", "64"]
