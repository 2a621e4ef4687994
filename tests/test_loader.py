"""`TokenDatasetLoader`: every token once per epoch when packing, segment ids and positions,
disjoint host shares, exact restore, the zigzag layout, padding mode."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from data import dataset_io
from data.batches import BATCH_FIELDS, WINDOW_FIELD
from data.loader import TokenDatasetLoader, plan_epoch
from data.tokens import frame_cells, frame_window
from lwm.attention import keys_precede_queries, look_back

SEQ = 32


def write_dataset(directory, lengths, shards=2, seed=0, vision=0.5):
    """Examples whose tokens say where they come from: token j of example i is i*1000 + j;
    each token is vision with probability ``vision``."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    per = -(-len(lengths) // shards)
    shard_lengths, total_bytes = [], 0
    for s in range(shards):
        writer = dataset_io.ShardWriter(directory / dataset_io.shard_name("train", s, shards))
        for i in range(s * per, min((s + 1) * per, len(lengths))):
            n = lengths[i]
            writer.write(
                {
                    "tokens": (i * 1000 + np.arange(n)).astype(np.int32),
                    "vision_mask": rng.random(n) < vision,
                    "loss_mask": (rng.random(n) < 0.7).astype(np.uint8),
                    "source": f"video{i}.mp4",
                    "kind": "video",
                    "num_frames": 1,
                }
            )
        writer.close()
        shard_lengths.append(writer.count)
        total_bytes += writer.num_bytes
    np.save(dataset_io.lengths_path(directory, "train"), np.asarray(lengths, np.int32))
    dataset_io.write_metadata(directory, "train", shard_lengths, total_bytes, {"test": 1}, "test")
    return directory


LENGTHS = [5, 31, 32, 33, 70, 1, 12, 12, 20, 9, 64, 3, 17, 40, 8, 26]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("loader") / "ds", LENGTHS)


def loader(path, **kw):
    args = dict(batch_size=4, seq_len=SEQ, seed=3)
    args.update(kw)
    return TokenDatasetLoader(path, **args)


def epoch_batches(ld):
    n = ld.batches_in_epoch(0)
    return [next(ld) for _ in range(n)]


def count_reads(ld) -> list[int]:
    """Route ``ld``'s reads of its dataset through a list: each read appends its index."""
    source, reads = ld.source, []

    class Counting:
        def __getitem__(self, i):
            reads.append(i)
            return source[i]

        def __len__(self):
            return len(source)

    ld.source = Counting()
    return reads


def test_packing_emits_every_token_once_with_segments_and_positions(dataset):
    ld = loader(dataset)
    batches = epoch_batches(ld)
    seen = []
    for b in batches:
        assert set(b) == set(BATCH_FIELDS)
        assert b["tokens"].shape == (4, SEQ)
        for r in range(4):
            tok, seg, pos = b["tokens"][r], b["segment_ids"][r], b["positions"][r]
            # segments 1, 2, .. in order, then padding 0 at the end only
            real = seg > 0
            assert not real[real.argmin() :].any() or real.all()
            ids = seg[real]
            assert (np.diff(ids) >= 0).all() and (ids[0] == 1 if len(ids) else True)
            assert set(np.unique(ids)) == set(range(1, ids.max() + 1)) if len(ids) else True
            for s in np.unique(ids):
                where = seg == s
                np.testing.assert_array_equal(pos[where], np.arange(where.sum()))
                piece = tok[where]
                example, offset = piece[0] // 1000, piece[0] % 1000
                # a piece is a contiguous run of one example; a split starts at k * seq_len
                np.testing.assert_array_equal(
                    piece, example * 1000 + offset + np.arange(len(piece))
                )
                assert offset % SEQ == 0
            seen += tok[real].tolist()
            # padding counts its positions, so the row is in order whole (the cuDNN
            # kernel's `in_order` schedule)
            np.testing.assert_array_equal(pos[~real], np.arange((~real).sum()))
        assert keys_precede_queries(b["positions"], b["segment_ids"], np)
    expected = [i * 1000 + j for i, n in enumerate(LENGTHS) for j in range(n)]
    assert sorted(seen) == expected  # every token exactly once
    # the next batch is from epoch 1, in another order
    assert ld.state()["epoch"] == 1 and ld.state()["batch"] == 0
    nxt = next(ld)
    assert ld.state()["epoch"] == 1 and ld.state()["batch"] == 1
    assert not np.array_equal(nxt["tokens"], batches[0]["tokens"])


def test_documents_are_split_only_when_longer_than_a_row():
    lengths = np.array([20, 20, 70, 5])
    plan = plan_epoch(np.arange(4), lengths, 32, pack=True)
    rows = [plan.row(r) for r in range(plan.num_rows)]
    assert rows == [
        [(0, 0, 20)],
        [(1, 0, 20)],  # 20 does not fit after 20: a new row, not a split
        [(2, 0, 32)],
        [(2, 32, 32)],
        [(2, 64, 6), (3, 0, 5)],
    ]


def test_targets_stay_inside_documents_and_follow_loss_mask(dataset):
    b = next(loader(dataset, batch_size=2))
    seg, w = b["segment_ids"], b["target_weight"]
    # no target at the last position of a segment, nor on padding
    last = np.concatenate([seg[:, 1:] != seg[:, :-1], np.ones((2, 1), bool)], axis=1)
    assert (w[last] == 0).all() and (w[seg == 0] == 0).all()
    np.testing.assert_array_equal(
        b["target_tokens"][:, :-1][~last[:, :-1]], b["tokens"][:, 1:][~last[:, :-1]]
    )
    # elsewhere a target weighs the loss_mask its example gives the next token (token j of
    # example i is i * 1000 + j, `write_dataset`)
    ld = loader(dataset, batch_size=2)
    nxt = b["tokens"][:, 1:][~last[:, :-1]]
    want = [ld.source[int(t) // 1000]["loss_mask"][int(t) % 1000] for t in nxt]
    np.testing.assert_array_equal(w[:, :-1][~last[:, :-1]], want)
    assert 0 < np.mean(want) < 1  # both kinds are there


def test_two_hosts_read_disjoint_shares_that_cover_the_dataset(dataset):
    whole = epoch_batches(loader(dataset))
    hosts = [loader(dataset, process_index=i, process_count=2) for i in range(2)]
    assert hosts[0].batches_in_epoch(0) == hosts[1].batches_in_epoch(0) == len(whole)
    tokens = [[], []]
    for b in range(len(whole)):
        parts = [next(h) for h in hosts]
        for i in range(2):
            assert parts[i]["tokens"].shape == (2, SEQ)
            real = parts[i]["segment_ids"] > 0
            tokens[i] += parts[i]["tokens"][real].tolist()
        for key in BATCH_FIELDS:  # host i's rows are rows 2i, 2i+1 of the global batch
            np.testing.assert_array_equal(
                np.concatenate([parts[0][key], parts[1][key]]), whole[b][key]
            )
        # how far back the whole batch's queries look, from the plan, alike on both hosts
        # (`lwm train` with many processes compiles its step for it)
        seen = look_back(whole[b]["segment_ids"], SEQ, np)
        assert hosts[0].last_look_back() == hosts[1].last_look_back() == seen
    assert tokens[0] and tokens[1] and not set(tokens[0]) & set(tokens[1])
    expected = {i * 1000 + j for i, n in enumerate(LENGTHS) for j in range(n)}
    assert set(tokens[0]) | set(tokens[1]) == expected
    assert hosts[0].state() == hosts[1].state()  # one state serves every host


def test_restored_loader_yields_the_same_batches(dataset):
    original = loader(dataset)
    n = original.batches_in_epoch(0)
    for _ in range(n - 1):  # stop just before the epoch ends
        next(original)
    state = json.loads(json.dumps(original.state()))
    expected = [next(original) for _ in range(n + 2)]  # across the epoch boundary
    restored = loader(dataset)
    restored.restore(state)
    for want in expected:
        got = next(restored)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    with pytest.raises(ValueError, match="seed"):
        loader(dataset, seed=4).restore(state)


def test_code_cells_are_those_of_the_whole_document(tmp_path):
    """A document split across rows keeps counting its frame's cells in the next row (the
    loader takes `frame_cells` of the whole example, not of the row), and a code's window of
    neighbours (`frame_window`, asked for with ``window``) is that of the whole example too:
    at a row's start it still names the codes left behind in the row before."""
    long_frames = write_dataset(tmp_path / "frames", LENGTHS[:9], vision=0.95)  # codes < 8192
    ld = loader(long_frames, window=((4, 4), 1))
    plain = next(loader(long_frames))
    assert WINDOW_FIELD not in plain  # only when asked for
    whole, near = {}, {}
    split = reached = 0
    for b in epoch_batches(ld):
        for r in range(b["tokens"].shape[0]):
            for at in np.flatnonzero(b["segment_ids"][r]):
                ex, j = divmod(int(b["tokens"][r, at]), 1000)
                if ex not in whole:
                    record = ld.source[ex]
                    whole[ex] = frame_cells(record["tokens"], record["vision_mask"])
                    near[ex] = frame_window(record["tokens"], record["vision_mask"], (4, 4), 1)
                assert b["frame_cells"][r, at] == whole[ex][j], (ex, j)
                np.testing.assert_array_equal(b[WINDOW_FIELD][r, at], near[ex][j])
                split += int(b["positions"][r, at] != j and whole[ex][j] > 0)
                # a neighbour from before the row's start
                reached += int(at == 0 and (near[ex][j] >= 0).any())
    assert split > 0  # some row starts inside a frame of a split document
    assert reached > 0


def test_zigzag_layout_permutes_the_unpermuted_batch(dataset):
    from lwm.attention.layout import zigzag_permutation

    perm = np.asarray(zigzag_permutation(SEQ, 4))
    plain, zig = next(loader(dataset)), next(loader(dataset, layout=perm))
    for key in BATCH_FIELDS:
        np.testing.assert_array_equal(zig[key], plain[key][:, perm])
    assert not np.array_equal(zig["tokens"], plain["tokens"])


def test_pad_mode_one_example_per_row_truncated(dataset):
    ld = loader(dataset, pack=False)
    batches = []
    for _ in range(ld.batches_in_epoch(0)):
        batches.append(next(ld))
        assert ld.last_look_back() == look_back(batches[-1]["segment_ids"], SEQ, np)
    starts = set()
    for b, r in [(b, r) for b in batches for r in range(4)]:
        seg = b["segment_ids"][r]
        if not seg.any():
            continue
        assert set(np.unique(seg)) <= {0, 1}
        n = int((seg == 1).sum())
        first = int(b["tokens"][r][0])
        assert first % 1000 == 0
        assert n == min(LENGTHS[first // 1000], SEQ)  # longer examples are truncated
        starts.add(first // 1000)
    assert starts == set(range(len(LENGTHS)))


def test_training_refuses_a_dataset_with_other_markers_vocabularies_or_grid(tmp_path):
    # lwm train checks a dataset's markers and vocabularies against the token stream's
    # (data.tokens) and the model's before the first step.
    from data.tokens import EOF_ID, EOV_ID
    from lwm.config import load_config
    from lwm.train_data import TrainingInputError, build_loader

    def dataset(name, **metadata):
        path = write_dataset(tmp_path / name, LENGTHS[:4], shards=1)
        meta = {"text_tokenizer": {"vocab_size": 100}, "markers": {"eof": EOF_ID, "eov": EOV_ID}}
        meta.update(metadata)
        (path / "metadata.json").write_text(json.dumps(meta))
        return path

    def loader_for(path, *overrides):
        cfg = load_config("configs/debug.yaml", [f"data.source={path}", *overrides])
        return build_loader(cfg, SEQ, None)

    assert loader_for(dataset("ok"), "train.batch_size=4")
    # what the loader itself refuses is one line too (a traceback before)
    with pytest.raises(TrainingInputError, match="has no split 'bogus'; it has train"):
        loader_for(tmp_path / "ok", "train.batch_size=4", "data.split=bogus")
    moved = dataset("moved", markers={"eof": EOF_ID + 10, "eov": EOV_ID + 10})
    with pytest.raises(TrainingInputError, match=f"uses {{'eof': {EOF_ID}, 'eov': {EOV_ID}}}"):
        loader_for(moved, "train.batch_size=4")
    big = dataset("big", text_tokenizer={"vocab_size": 10**6})
    with pytest.raises(TrainingInputError, match="text vocabulary of 1000000 tokens"):
        loader_for(big, "train.batch_size=4")
    codes = dataset("codes", vqgan={"codebook_size": 1024})
    with pytest.raises(
        TrainingInputError, match="VQGAN of 1024 codes, but model.vision_codes is 512"
    ):
        loader_for(codes, "train.batch_size=4", "model.vision_codes=512")
    grid = dataset("grid", vqgan={"codebook_size": 512, "tokens_per_frame": 64})
    assert loader_for(grid, "train.batch_size=4", "model.vision_grid=[8,8]")
    with pytest.raises(
        TrainingInputError, match=r"64 codes per frame, but model.vision_grid \[4, 4\]"
    ):
        loader_for(grid, "train.batch_size=4", "model.vision_grid=[4,4]")


def test_grain_read_ahead_gives_the_plain_readers_batches_and_states(dataset):
    """grain with 3 threads reading 5 batches ahead vs. reading each batch when asked (no
    grain): the same batches over three epochs, and each one's state resumes the other."""
    plain, ahead = loader(dataset, read_threads=0), loader(dataset, read_threads=3, prefetch=5)
    n = plain.batches_in_epoch(0) + plain.batches_in_epoch(1) + 2
    for _ in range(n):
        want, got = next(plain), next(ahead)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    state = json.loads(json.dumps(ahead.state()))
    assert state["grain"] == {"next_index": n}  # grain's own iterator state, checkpointed
    assert {k: v for k, v in state.items() if k != "grain"} == plain.state()
    for source, target in (
        (state, loader(dataset, read_threads=0)),
        (plain.state(), loader(dataset)),
    ):
        target.restore(source)
        want = next(plain) if target.read_threads == 0 else next(ahead)
        got = next(target)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_worker_processes_give_the_plain_readers_batches_and_resume_from_its_state(dataset):
    """`read_processes`: two worker processes read and pack the batches (grain's
    mp_prefetch): the plain reader's batches in its order over three epochs, a state that a
    plain reader resumes from and one it resumes from, and a clean close."""
    plain, workers = loader(dataset, read_threads=0), loader(dataset, read_processes=2)
    n = plain.batches_in_epoch(0) + plain.batches_in_epoch(1) + 2
    try:
        for _ in range(n):
            want, got = next(plain), next(workers)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
        state = json.loads(json.dumps(workers.state()))
        assert state == plain.state()  # no per-worker grain state: the next batch alone
        resumed = loader(dataset, read_processes=2)
        resumed.restore(state)
        for _ in range(3):
            want, got = next(plain), next(resumed)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
        resumed.close()
    finally:
        workers.close()
    with pytest.raises(ValueError, match="read_processes -1 is negative"):
        loader(dataset, read_processes=-1)


@pytest.mark.parametrize(
    ("lengths", "tight"),
    [((369, 411), 832), ((276, 289), 896), ((600, 700), 704), ((300, 411), None)],
)
def test_the_demos_tight_rows_hold_the_same_records_as_rows_of_1024(tmp_path, lengths, tight):
    path = Path(__file__).resolve().parents[1] / "recipes" / "demo.py"
    spec = importlib.util.spec_from_file_location("demo_script", path)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    rng = np.random.default_rng(0)
    sizes = rng.integers(lengths[0], lengths[1] + 1, 500)
    sizes[:2] = lengths  # the shortest and the longest are there
    np.save(tmp_path / "num_tokens-train.npy", sizes)
    overrides = demo.tight_rows(tmp_path, "2,1,2,1")
    if tight is None:  # rows of 1,024 hold different numbers of these: nothing changes
        assert overrides == []
        return
    assert overrides == [f"train.seq_len={tight}", *(f"model.block_{x}={tight // 8}" for x in "qk")]
    order = rng.permutation(len(sizes))
    a, b = plan_epoch(order, sizes, 1024, pack=True), plan_epoch(order, sizes, tight, pack=True)
    assert a.num_rows == b.num_rows
    assert all(a.row(r) == b.row(r) for r in range(a.num_rows))


def test_a_dataset_naming_a_foreign_feature_class_is_refused_before_tfds_imports_it(
    dataset, tmp_path, monkeypatch
):
    """tfds imports the module of every `pythonClassName` in features.json: a dataset from
    someone else could make the loader import any module it can reach (here one beside where
    the command runs). The loader refuses such a dataset in one line and imports nothing."""
    import shutil

    marker = tmp_path / "imported"
    (tmp_path / "evil_features.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = tmp_path / "ds"
    shutil.copytree(dataset, bad)
    features = json.loads((bad / "features.json").read_text())
    kind = features["featuresDict"]["features"]["kind"]
    kind["pythonClassName"] = "evil_features.Text"
    (bad / "features.json").write_text(json.dumps(features))
    with pytest.raises(ValueError, match=r"names the feature class 'evil_features.Text', which"):
        loader(bad)
    assert not marker.exists() and "evil_features" not in sys.modules
    assert loader(dataset).batches_in_epoch(0) > 0  # tfds's own classes load as before


def test_records_kept_between_epochs_give_the_same_batches_and_are_not_read_again(
    tmp_path, monkeypatch
):
    """The records a loader keeps (`TokenDatasetLoader.record`, for fast chips): over three
    epochs the same batches (cells and windows included) with nothing kept, with a budget that
    holds a few records (so some are dropped and read again) and with the default; with the
    default, the epochs after the first read no record from the dataset, and a small budget is
    never exceeded."""
    import data.loader as loader_module

    path = write_dataset(tmp_path / "ds", LENGTHS, vision=0.9)
    reads = {}
    made = {}
    for name, budget in (("none", 0), ("small", 1500), ("default", None)):
        if budget is not None:
            monkeypatch.setattr(loader_module, "RECORD_CACHE_BYTES", budget)
        else:
            monkeypatch.undo()
        ld = loader(path, read_threads=0, window=((4, 4), 1))
        reads[name] = count_reads(ld)
        first = ld.batches_in_epoch(0)
        made[name] = epoch_batches(ld) + [next(ld) for _ in range(2 * first)]
        if name == "default":
            assert len(reads[name]) == len(LENGTHS)  # each record read once, in the first epoch
        if name == "small":
            assert 0 < ld._record_bytes <= budget and 0 < len(ld._records) < len(LENGTHS)
            assert len(reads[name]) > len(LENGTHS)
    assert len(reads["none"]) > 2 * len(LENGTHS)  # without: every visit reads
    for name in ("small", "default"):
        assert len(made[name]) == len(made["none"])
        for want, got in zip(made["none"], made[name], strict=True):
            assert set(got) == set(want)
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])


def test_warming_reads_the_rest_of_the_epoch_ahead_and_changes_no_batch(tmp_path, monkeypatch):
    """`TokenDatasetLoader.warm` (run while the train step compiles): after it, the rest of the
    epoch, from where a restored loader stands, reads no record from the dataset, and gives the
    batches a loader that did not warm gives; it fills at most half the record cache, so the
    records it kept are not dropped before they are read; worker processes do not warm."""
    import data.loader as loader_module

    path = write_dataset(tmp_path / "ds", LENGTHS, vision=0.9)
    plain = loader(path, read_threads=0, window=((4, 4), 1))
    n = plain.batches_in_epoch(0)
    skipped = [next(plain) for _ in range(2)]
    state = json.loads(json.dumps(plain.state()))
    want = [next(plain) for _ in range(n - 2)]
    rest = {ex for b in want for ex in np.unique(b["tokens"][b["tokens"] > 0] // 1000)}
    assert skipped and len(rest) < len(LENGTHS)  # the epoch's first batches are not warmed

    warmed = loader(path, read_threads=0, window=((4, 4), 1))
    warmed.restore(state)
    warmed.warm().join()
    assert set(warmed._records) == rest
    reads = count_reads(warmed)
    for a, b in zip(want, [next(warmed) for _ in range(n - 2)], strict=True):
        assert set(a) == set(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert reads == []

    monkeypatch.setattr(loader_module, "RECORD_CACHE_BYTES", 4000)
    small = loader(path, read_threads=0)
    small.warm().join()
    assert 0 < len(small._records) < len(LENGTHS) and small._record_bytes <= 4000  # none dropped
    last = small._records[next(reversed(small._records))]  # it began below half the cache
    assert small._record_bytes - sum(a.nbytes for a in last.values()) <= 2000 < small._record_bytes
    assert loader(path, read_processes=1).warm() is None
