"""Isolated QA turns (`data.qa_turns: isolated`): each question turn of a packed training row
sees its record's video and itself, at the positions right after the video, exactly as
`lwm ask` asks it alone; no turn sees another."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import assert_matches, mesh_of, qkv
from test_model import _assert_close, debug_cfg, loss_and_grads

from data import dataset_io
from data.batches import (
    MAX_TURNS,
    TURN_BITS,
    TURN_FLAG,
    next_token_targets,
    segments_see,
    turn_segment_ids,
)
from data.loader import TokenDatasetLoader
from data.tokens import TextCodec, build_example, record_turns
from lwm.attention import (
    blockwise_attention,
    dense_attention,
    keys_precede_queries,
    look_back,
    ring_attention,
)
from lwm.attention.layout import zigzag_permutation
from lwm.base.mesh import make_mesh
from lwm.model import create_model

QA = [
    [
        {"question": "How many shapes move in the video?", "answer": "two"},
        {"question": "What colour is the moving circle?", "answer": "red"},
        {"question": "What appeared briefly?", "answer": "a blue square"},
    ],
    [
        {"question": "What shape is the green one?", "answer": "triangle"},
        {
            "question": "Which direction does the green triangle move?",
            "answer": "up",
            "learn": False,
        },
    ],
]


@pytest.fixture(scope="module")
def codec():
    return TextCodec.load(None)


def video(seed: int) -> np.ndarray:
    """Codes of a 2-frame 2x2 video that include the ids of EOS and </vision> as codes."""
    codes = np.random.default_rng(seed).integers(0, 16, (2, 2, 2)).astype(np.int32)
    codes[0, 0, 0], codes[1, 1, 1] = 2, 4  # text EOS and </vision> ids, as vision codes
    return codes


def records(codec):
    return [build_example(codec, video(i), qa=qa) for i, qa in enumerate(QA)]


def records_with(codec, learn):
    """`records` with the second turn of each marked ``"learn": learn``."""
    marked = [[{**t, "learn": learn} if k == 1 else t for k, t in enumerate(r)] for r in QA]
    return [build_example(codec, video(i), qa=qa) for i, qa in enumerate(marked)]


def test_record_turns_are_the_turns_of_the_record(codec):
    """Turn 0 of a QA record, then turn k, are the record of turn k alone (as `lwm ask` would
    prompt it, and the answer), token for token, at the same positions."""
    assert codec.eos_id == 2 and codec.vision_end == [4]  # what `video` plants as codes
    for i, qa in enumerate(QA):
        ex = build_example(codec, video(i), qa=qa)
        turn, positions = record_turns(
            ex["tokens"], ex["vision_mask"], codec.vision_end, codec.eos_id
        )
        assert turn.max() == len(qa)
        for k, one in enumerate(qa, 1):
            alone = build_example(codec, video(i), qa=[one])
            seen = (turn == 0) | (turn == k)
            assert ex["tokens"][seen].tolist() == alone["tokens"].tolist()
            assert positions[seen].tolist() == list(range(len(alone["tokens"])))
            assert ex["loss_mask"][seen].tolist() == alone["loss_mask"].tolist()
    # Records without a video are one turn, positions 0 .. n-1.
    text = build_example(codec, text="Hello world.")
    turn, positions = record_turns(text["tokens"], text["vision_mask"], codec.vision_end, 2)
    assert not turn.any() and positions.tolist() == list(range(len(text["tokens"])))


def test_which_segments_see_which():
    doc1 = [turn_segment_ids(1, t) for t in range(3)]
    doc2 = [turn_segment_ids(2, t) for t in range(3)]
    assert int(doc1[2]) == TURN_FLAG | 1 << TURN_BITS | 2
    ids = [0, 1, 2, -1, -2, *map(int, doc1), *map(int, doc2)]
    expected = {(q, k): q == k for q in ids for k in ids}  # plain ids: equal ones only
    expected[int(doc1[1]), int(doc1[0])] = expected[int(doc1[2]), int(doc1[0])] = True
    expected[int(doc2[1]), int(doc2[0])] = expected[int(doc2[2]), int(doc2[0])] = True
    got = segments_see(np.asarray(ids)[:, None], np.asarray(ids)[None])
    want = np.asarray([[expected[q, k] for k in ids] for q in ids])
    assert (got == want).all()
    # the kernels' padding keys (-1) are seen by no query of another id, flagged ones included
    assert got[:, ids.index(-1)].sum() == 1 and not got[ids.index(-2), ids.index(-1)]


def write_records(directory, examples, tokenizer: dict | None):
    directory.mkdir(parents=True)
    writer = dataset_io.ShardWriter(directory / dataset_io.shard_name("train", 0, 1))
    for ex in examples:
        writer.write({**ex, "source": "v.mp4", "kind": "qa", "num_frames": 2})
    writer.close()
    lengths = np.asarray([len(ex["tokens"]) for ex in examples], np.int32)
    np.save(dataset_io.lengths_path(directory, "train"), lengths)
    meta = {} if tokenizer is None else {"text_tokenizer": tokenizer}
    dataset_io.write_metadata(directory, "train", [writer.count], writer.num_bytes, meta, "test")
    return directory


@pytest.fixture(scope="module")
def isolated_batch(codec, tmp_path_factory):
    """One row holding both records of `QA`, loaded with isolated turns, unpermuted."""
    tokenizer = {"eos_id": codec.eos_id, "vision_end": codec.vision_end}
    path = write_records(tmp_path_factory.mktemp("turns") / "ds", records(codec), tokenizer)
    ld = TokenDatasetLoader(path, batch_size=1, seq_len=160, read_threads=0, qa_turns="isolated")
    batch = next(iter(ld))
    assert (batch["segment_ids"] != 0).sum() == sum(len(r["tokens"]) for r in records(codec))
    return path, batch


def test_the_loader_gives_each_turn_its_own_segment_and_the_videos_positions(codec, isolated_batch):
    path, batch = isolated_batch
    seg, pos = batch["segment_ids"][0], batch["positions"][0]
    docs = sorted({int(s) >> TURN_BITS for s in seg if s})
    assert len(docs) == 2
    for doc in docs:
        in_doc = (seg >> TURN_BITS) == doc
        ex = next(r for r in records(codec) if len(r["tokens"]) == in_doc.sum())
        turn, positions = record_turns(ex["tokens"], ex["vision_mask"], codec.vision_end, 2)
        assert (seg[in_doc] & MAX_TURNS).tolist() == turn.tolist()
        assert pos[in_doc].tolist() == positions.tolist()
        assert batch["tokens"][0][in_doc].tolist() == ex["tokens"].tolist()
    # Every key a query sees comes before it, padding included (the cuDNN kernel's
    # `in_order` schedule); with the padding all at one position it would not.
    segs = batch["segment_ids"]
    assert keys_precede_queries(batch["positions"], segs, np) and (segs == 0).sum() > 1
    # how far back its queries look, from the loader's plan: a record's turns are one document
    ld = TokenDatasetLoader(path, batch_size=1, seq_len=160, read_threads=0, qa_turns="isolated")
    next(ld)
    assert ld.last_look_back() == look_back(segs, 160, np) < 160
    flat = np.where(segs == 0, 0, batch["positions"])
    assert not keys_precede_queries(flat, segs, np)
    # Targets: an answer token is the target of the token before it in its turn; no target
    # crosses from one turn to the next; the trained answers are the records' own.
    seg2 = batch["segment_ids"]
    t = next_token_targets(batch["tokens"], batch["vision_mask"], np.ones_like(seg2), seg2)
    for i in range(seg.shape[0] - 1):
        crosses = seg[i] != seg[i + 1] and (seg[i + 1] & MAX_TURNS) != 1
        if crosses:
            assert t.weight[0, i] == 0
    trained = int(batch["target_weight"].sum())
    assert trained == sum(int(r["loss_mask"][1:].sum()) for r in records(codec))
    # A chained loader's state does not restore an isolated one.
    chained = TokenDatasetLoader(path, batch_size=1, seq_len=160, read_threads=0)
    isolated = TokenDatasetLoader(path, batch_size=1, seq_len=160, qa_turns="isolated")
    with pytest.raises(ValueError, match="qa_turns differ"):
        isolated.restore(chained.state())


def test_isolated_turns_need_the_tokenizers_ids(codec, tmp_path):
    path = write_records(tmp_path / "ds", records(codec), None)
    with pytest.raises(ValueError, match="EOS id and the </vision> ids"):
        TokenDatasetLoader(path, batch_size=1, seq_len=160, qa_turns="isolated")
    with pytest.raises(ValueError, match="unknown qa_turns 'loose'"):
        TokenDatasetLoader(path, batch_size=1, seq_len=160, qa_turns="loose")


def test_a_turn_in_an_isolated_row_is_the_turn_asked_alone(codec, isolated_batch):
    """The model's text logits at every token of every turn of the packed row equal those of
    the record of that turn alone (BOS, video, the turn: `lwm ask`'s prompt and the answer)."""
    _, batch = isolated_batch
    model = create_model(
        debug_cfg(attention="blockwise", block_q=16, block_k=16, text_vocab_size=4096)
    )
    fields = ("tokens", "vision_mask", "positions", "segment_ids")
    text, _ = model(*(jnp.asarray(batch[k]) for k in fields))
    seg = batch["segment_ids"][0]
    compared = 0
    for i, qa in enumerate(QA):
        ex = records(codec)[i]
        doc = next(
            d
            for d in {int(s) >> TURN_BITS for s in seg if s}
            if ((seg >> TURN_BITS) == d).sum() == len(ex["tokens"])
        )
        for k, one in enumerate(qa, 1):
            alone = build_example(codec, video(i), qa=[one])
            n = len(alone["tokens"])
            ref, _ = model(
                jnp.asarray(alone["tokens"])[None],
                jnp.asarray(alone["vision_mask"])[None],
                jnp.arange(n, dtype=jnp.int32)[None],
                jnp.ones((1, n), jnp.int32),
            )
            at = np.flatnonzero(seg == int(turn_segment_ids(doc, k)))
            width = len(at)
            got = np.asarray(text[0, at])
            want = np.asarray(ref[0, n - width :])
            assert np.abs(got - want).max() <= 1e-5, (i, k)
            compared += width
    assert compared > 40


def test_a_ring_model_on_isolated_turns_equals_the_dense_one(isolated_batch):
    """Loss and gradients of the isolated row: ring attention over sp = 2 in the zigzag
    layout on a (1,1,2,1) mesh with 4-token blocks equals dense attention."""
    _, batch = isolated_batch
    row = {k: jnp.asarray(batch[k]) for k in ("tokens", "vision_mask", "positions", "segment_ids")}
    row["loss_mask"] = jnp.asarray(np.concatenate([[0], batch["target_weight"][0, :-1]])[None])
    cfg = dict(text_vocab_size=4096)
    ref_loss, _, ref_grads = loss_and_grads(create_model(debug_cfg(attention="dense", **cfg)), row)
    mesh = make_mesh("1,1,2,1", jax.devices()[:2])
    model = create_model(debug_cfg(attention="ring", block_q=4, block_k=4, **cfg), mesh=mesh)
    loss, _, grads = loss_and_grads(model, row, zigzag_permutation(160, 2))
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    _assert_close(grads, ref_grads, 1e-5)


def turn_segments(b: int, s: int, seed: int = 2) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Rows of packed documents, each a turn 0 then turns of random lengths, with the loader's
    segment ids and positions (each turn counts on from the end of its document's turn 0)."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, s), np.int32)
    pos = np.zeros((b, s), np.int32)
    for r in range(b):
        at, doc = 0, 1
        while at < s:
            n0 = min(int(rng.integers(3, 12)), s - at)
            seg[r, at : at + n0] = turn_segment_ids(doc, 0)
            pos[r, at : at + n0] = np.arange(n0)
            at += n0
            for t in range(1, int(rng.integers(1, 4)) + 1):
                n = min(int(rng.integers(2, 7)), max(s - at, 0))
                seg[r, at : at + n] = turn_segment_ids(doc, t)
                pos[r, at : at + n] = n0 + np.arange(n)
                at += n
            doc += 1
        seg[r, s - 3 :] = 0  # padding at the end of the row
    return jnp.asarray(seg), jnp.asarray(pos)


@pytest.mark.parametrize(
    "where", ["blockwise", "ring", "ring-pallas_interpreted", "ring-cudnn_schedule_with_standin"]
)
def test_attention_kernels_mask_isolated_turns_as_dense(where, monkeypatch):
    """Blockwise, and the ring with each block kernel (Pallas in interpret mode, cuDNN's
    stand-in on the CPU, in pieces of 8 so that some pairs run on it whole) equal dense
    attention on rows of isolated turns; dense attention is each turn with its turn 0 alone."""
    import lwm.attention.cudnn as cudnn

    monkeypatch.setattr(cudnn.pairs, "PIECE", 8)
    q, k, v = qkv(s=64)
    seg, pos = turn_segments(2, 64)
    perm = np.arange(64)
    if where != "blockwise":
        perm = zigzag_permutation(64, 2)
    seg, pos = seg[:, perm], pos[:, perm]
    q, k, v = q[:, perm], k[:, perm], v[:, perm]
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg)
    if where == "blockwise":
        fn = lambda q, k, v: blockwise_attention(q, k, v, block_q=8, block_k=8, **kw)  # noqa: E731
    else:
        mesh = mesh_of((1, 1, 2, 1))
        kernel = where.removeprefix("ring-").split("_")[0] if "-" in where else "xla"
        fn = lambda q, k, v: ring_attention(  # noqa: E731
            q, k, v, mesh=mesh, block_q=4, block_k=4, kernel=kernel, **kw
        )
    assert_matches(fn, lambda q, k, v: dense_attention(q, k, v, **kw), q, k, v)
    # and dense attention with these ids is each turn attending to its turn 0 and itself
    out = dense_attention(q, k, v, **kw)
    for r in range(2):
        ids = np.asarray(seg[r])
        for t in sorted({int(i) for i in ids if i and int(i) & MAX_TURNS}):
            see = np.flatnonzero((ids == t) | (ids == (t >> TURN_BITS << TURN_BITS)))
            order = np.argsort(np.asarray(pos[r, see]), kind="stable")
            see = see[order]
            alone = dense_attention(
                q[r : r + 1, see],
                k[r : r + 1, see],
                v[r : r + 1, see],
                q_positions=pos[r : r + 1, see],
                kv_positions=pos[r : r + 1, see],
            )
            mine = np.asarray(ids[see] == t)
            assert np.abs(np.asarray(alone[0, mine]) - np.asarray(out[r, see[mine]])).max() < 1e-5


def test_mixed_turns_chain_a_drawn_share_of_the_records(codec, tmp_path):
    """``qa_turns="mixed"``: share 0 is the isolated loader, share 1 the chained one (the same
    tokens, positions, targets and the same attention between tokens, so the same logits);
    in between, each epoch chains a share of the records drawn by (seed, epoch)."""
    tokenizer = {"eos_id": codec.eos_id, "vision_end": codec.vision_end}
    path = write_records(tmp_path / "ds", records(codec), tokenizer)

    def batch(qa_turns: str, share: float = 0.5) -> dict[str, np.ndarray]:
        ld = TokenDatasetLoader(
            path, batch_size=1, seq_len=160, read_threads=0, qa_turns=qa_turns, chained_share=share
        )
        return next(iter(ld))

    isolated, chained = batch("isolated"), batch("chained")
    for k, v in batch("mixed", 0.0).items():
        assert (v == isolated[k]).all(), k
    mixed = batch("mixed", 1.0)
    for k in set(chained) - {"segment_ids"}:
        assert (mixed[k] == chained[k]).all(), k
    seg, plain = mixed["segment_ids"][0], chained["segment_ids"][0]
    real = plain != 0
    assert ((seg[real] & MAX_TURNS) == 0).all() and (seg[real] >= TURN_FLAG).all()
    assert (seg[~real] == 0).all()
    assert (segments_see(seg[:, None], seg[None]) == (plain[:, None] == plain[None])).all()
    model = create_model(
        debug_cfg(attention="blockwise", block_q=16, block_k=16, text_vocab_size=4096)
    )
    fields = ("tokens", "vision_mask", "positions", "segment_ids")
    got, _ = model(*(jnp.asarray(mixed[k]) for k in fields))
    want, _ = model(*(jnp.asarray(chained[k]) for k in fields))
    assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 1e-5

    # 200 records: a share of them chained, another draw each epoch, the same on every loader.
    many = write_records(tmp_path / "many", records(codec) * 100, tokenizer)

    def loader(share: float, seed: int = 0) -> TokenDatasetLoader:
        return TokenDatasetLoader(
            many, batch_size=2, seq_len=160, seed=seed, qa_turns="mixed", chained_share=share
        )

    first, second = loader(0.25).chained_records(0), loader(0.25).chained_records(1)
    assert 30 <= first.sum() <= 70 and 30 <= second.sum() <= 70
    assert (first != second).any() and (first == loader(0.25).chained_records(0)).all()
    assert (loader(0.25, seed=1).chained_records(0) != first).any()
    # Every document of a batch is chained (one segment id) exactly when drawn so.
    ld = loader(0.25)
    ld.read_threads = 0
    b = next(iter(ld))
    plan, drawn = ld.plan(0), ld.chained_records(0)
    for r in range(2):
        for doc, (ex, _, _) in enumerate(plan.row(r), 1):
            seg = b["segment_ids"][r]
            ids = seg[(seg >> TURN_BITS) == int(turn_segment_ids(doc, 0)) >> TURN_BITS]
            assert len(ids)
            assert (len(set(ids.tolist())) == 1) == bool(drawn[ex]), (r, doc)
    with pytest.raises(ValueError, match="chained_share differ"):
        ld.restore(loader(0.5).state())
    with pytest.raises(ValueError, match=r"chained_share 1.5 is not in \[0, 1\]"):
        loader(1.5)


def test_answers_learned_alone_weigh_only_where_their_turn_is_isolated(codec, tmp_path):
    """A turn marked ``"learn": "alone"`` is learned as an ordinary turn with isolated turns and
    as a context-only turn (``"learn": false``) with chained ones; with mixed turns, one or the
    other by whether its record was drawn chained. Every other field is unchanged."""
    tokenizer = {"eos_id": codec.eos_id, "vision_end": codec.vision_end}

    def dataset(name: str, learn, copies: int = 1):
        return write_records(tmp_path / name, records_with(codec, learn) * copies, tokenizer)

    def batch(path, qa_turns: str, share: float = 0.5) -> dict[str, np.ndarray]:
        ld = TokenDatasetLoader(
            path, batch_size=1, seq_len=160, read_threads=0, qa_turns=qa_turns, chained_share=share
        )
        return next(iter(ld))

    alone, learned, context = dataset("alone", "alone"), dataset("on", True), dataset("off", False)
    for qa_turns, share, same_as in [
        ("isolated", 0.5, learned),
        ("chained", 0.5, context),
        ("mixed", 0.0, learned),
        ("mixed", 1.0, context),
    ]:
        got, want = batch(alone, qa_turns, share), batch(same_as, qa_turns, share)
        for k in want:
            assert (got[k] == want[k]).all(), (qa_turns, share, k)
    assert (
        batch(learned, "isolated")["target_weight"] != batch(context, "isolated")["target_weight"]
    ).any()
    # Mixed, 200 records: a record's "alone" answer weighs exactly when it is not drawn.
    masks = [r["loss_mask"] for r in records_with(codec, "alone")]
    as_isolated = [int((m[1:] > 0).sum()) for m in masks]
    as_chained = [int((m[1:] == 1).sum()) for m in masks]
    assert all(c < i for c, i in zip(as_chained, as_isolated, strict=True))
    ld = TokenDatasetLoader(
        dataset("many", "alone", copies=100),
        batch_size=2,
        seq_len=160,
        read_threads=0,
        qa_turns="mixed",
        chained_share=0.5,
    )
    plan, drawn = ld.plan(0), ld.chained_records(0)
    seen = []
    for g in range(4):
        b = ld.read(g)
        for r in range(2):
            seg, weight = b["segment_ids"][r], b["target_weight"][r]
            for doc, (ex, _, _) in enumerate(plan.row(2 * g + r), 1):
                in_doc = (seg >> TURN_BITS) == int(turn_segment_ids(doc, 0)) >> TURN_BITS
                want = (as_chained if drawn[ex] else as_isolated)[ex % 2]
                assert int(weight[in_doc].sum()) == want, (g, r, doc)
                seen.append(bool(drawn[ex]))
    assert set(seen) == {True, False}
