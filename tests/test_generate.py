"""Generation: cached decoding equals full forward passes; sampling filters; vision mode; CFG."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lwm.base.mesh import make_mesh
from lwm.config import load_config
from lwm.generate import EOF_ID, EOV_ID, Sampling, generate, prefill, sample_logits
from lwm.model import create_model


def debug_cfg(**overrides):
    return load_config("configs/debug.yaml").model.model_copy(update=overrides)


def prompts(b=2, p=11, lens=(11, 6), seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (b, p)).astype(np.int32)
    vision = np.zeros((b, p), bool)
    vision[:, 2:5] = True  # a few vision codes inside the prompt
    return jnp.asarray(tokens), jnp.asarray(vision), jnp.asarray(lens, jnp.int32)


def greedy_by_full_forward(model, tokens, vision, lens, steps, mode="text", multiple=1):
    """Reference: append the argmax of a full forward pass, one token at a time (all rows in
    one right-padded batch of fixed width; causal attention never sees the padding)."""
    width = -(-(tokens.shape[1] + steps) // multiple) * multiple  # ring needs whole shards
    seqs = np.zeros((tokens.shape[0], width), np.int32)
    vis = np.zeros((tokens.shape[0], width), bool)
    seqs[:, : tokens.shape[1]], vis[:, : tokens.shape[1]] = tokens, vision
    forward = nnx.jit(lambda m, t, v: m(t, v))
    n = np.asarray(lens).copy()
    rows = np.arange(tokens.shape[0])
    for _ in range(steps):
        text, vision_logits = forward(model, jnp.asarray(seqs), jnp.asarray(vis))
        logits = np.asarray(vision_logits if mode == "vision" else text)
        seqs[rows, n] = logits[rows, n - 1].argmax(-1)
        vis[rows, n] = mode == "vision"
        n += 1
    return [seqs[r, int(lens[r]) : int(lens[r]) + steps].tolist() for r in rows]


@pytest.mark.parametrize(
    "mesh_shape,attention,kernel",
    [
        (None, "blockwise", "xla"),
        pytest.param(  # one device: the prompt is one document in its order
            None, "blockwise", "cudnn", id="None-blockwise-cudnn_schedule_with_standin"
        ),
        ("1,1,4,2", "ring", "xla"),
        ("1,2,2,2", "ring", "xla"),
        pytest.param(  # the prompt's prefill on the cuDNN schedule (its kernels' stand-in)
            "1,2,2,2", "ring", "cudnn", id="1,2,2,2-ring-cudnn_schedule_with_standin"
        ),
    ],
)
def test_greedy_with_cache_equals_full_forward(mesh_shape, attention, kernel):
    mesh = None if mesh_shape is None else make_mesh(mesh_shape)
    cfg = debug_cfg(attention=attention, block_q=4, block_k=4, attention_kernel=kernel)
    model = create_model(cfg, mesh=mesh)
    tokens, vision, lens = prompts()
    out, lengths = generate(model, tokens, vision, lens, key=jax.random.key(0), max_new_tokens=7)
    sp = 1 if mesh is None else mesh.shape["sp"]
    ref = greedy_by_full_forward(model, tokens, vision, lens, 7, multiple=sp)
    assert np.asarray(out).tolist() == ref
    assert np.asarray(lengths).tolist() == [7, 7]


def test_prefill_in_the_prompts_order_decides_nothing_at_run_time():
    """On one device the prompt is one document in the model's layout, so prefill tells
    attention no positions: on the cuDNN kernel its calls are scheduled when tracing, with no
    conditional (on a GPU each one waits for its predicate). Its results are checked by
    `test_greedy_with_cache_equals_full_forward[None-blockwise-cudnn_schedule_with_standin]`."""
    model = create_model(debug_cfg(attention="blockwise", attention_kernel="cudnn"))
    graphdef, state = nnx.split(model)
    tokens, vision, lens = prompts(p=16)

    def run(state, tokens, vision, lens):
        return prefill(nnx.merge(graphdef, state), tokens, vision, lens, 32)

    hlo = jax.jit(run).lower(state, tokens, vision, lens).compile().as_text()
    assert hlo.count(" conditional(") == 0


def test_stop_tokens_end_rows_and_pad():
    model = create_model(debug_cfg())
    tokens, vision, lens = prompts()
    free, _ = generate(model, tokens, vision, lens, key=jax.random.key(0), max_new_tokens=6)
    stop = int(free[0, 2])
    out, lengths = generate(
        model,
        tokens,
        vision,
        lens,
        key=jax.random.key(0),
        max_new_tokens=6,
        stop_tokens=(stop,),
        pad_id=-1,
    )
    free = np.asarray(free)
    # both rows, and row 0 (whose third token is the stop) ends by its third: padding follows
    assert free.shape == np.asarray(out).shape == (2, 6) and int(lengths[0]) <= 3
    # every row: up to its first stop token as without one, then padding
    for row, (got, unstopped) in enumerate(zip(np.asarray(out), np.asarray(free), strict=True)):
        hits = np.flatnonzero(unstopped == stop)
        end = int(hits[0]) + 1 if len(hits) else len(unstopped)
        assert int(lengths[row]) == end, row
        assert got[:end].tolist() == unstopped[:end].tolist() and (got[end:] == -1).all(), row


def test_sampling_filters():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 50)) * 3, jnp.float32)
    logits = jnp.repeat(logits, 512, axis=0)
    keys = jax.random.key(1)
    greedy = int(jnp.argmax(logits[0]))
    top3 = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    got_k = set(np.asarray(sample_logits(logits, keys, Sampling(1.0, top_k=3))).tolist())
    assert got_k <= top3 and len(got_k) > 1
    assert set(np.asarray(sample_logits(logits, keys, Sampling(1.0, top_k=1))).tolist()) == {greedy}
    # a k at least the vocabulary keeps every token (it was JAX's error about top_k's k)
    every = np.asarray(sample_logits(logits, keys, Sampling(1.0)))
    for k in (50, 51, 10_000):
        assert (np.asarray(sample_logits(logits, keys, Sampling(1.0, top_k=k))) == every).all()
    assert set(np.asarray(sample_logits(logits, keys, Sampling(1.0, top_p=1e-6))).tolist()) == {
        greedy
    }
    # top_p keeps the smallest set of tokens whose probability reaches p.
    probs = np.sort(np.asarray(jax.nn.softmax(logits[0])))[::-1]
    need = int(np.searchsorted(np.cumsum(probs), 0.8) + 1)
    got_p = set(np.asarray(sample_logits(logits, keys, Sampling(1.0, top_p=0.8))).tolist())
    assert got_p <= set(np.argsort(-np.asarray(logits[0]))[:need].tolist())
    assert len(got_p) > 1


def test_temperature_scales_the_logits():
    """Sampling at temperature T draws from softmax(logits / T): two tokens a logit apart are
    drawn 1 : e^(1/T) (e^2 at T = 0.5, e^0.5 at T = 2), over 8192 rows each (the standard error
    of the share is under 0.006)."""
    logits = jnp.tile(jnp.asarray([[0.0, 1.0]], jnp.float32), (8192, 1))
    for t in (0.5, 2.0):
        drawn = np.asarray(sample_logits(logits, jax.random.key(3), Sampling(temperature=t)))
        want = 1 / (1 + np.exp(-1 / t))
        assert abs(drawn.mean() - want) < 0.03, (t, drawn.mean(), want)


def test_vision_mode_forces_frame_markers():
    model = create_model(debug_cfg())
    tokens, vision, lens = prompts()
    out, lengths = generate(
        model,
        tokens,
        vision,
        lens,
        key=jax.random.key(2),
        mode="vision",
        sampling=Sampling(temperature=1.0),
        tokens_per_frame=4,
        num_frames=3,
    )
    out = np.asarray(out)
    assert out.shape == (2, 15) and np.asarray(lengths).tolist() == [15, 15]
    assert (out[:, [4, 9]] == EOF_ID).all() and (out[:, 14] == EOV_ID).all()
    codes = np.delete(out, [4, 9, 14], axis=1)
    assert (codes < EOF_ID).all()


@pytest.mark.parametrize(
    "mesh_shape,codes,grid,window",
    [
        (None, 0, None, 0),
        ("1,1,4,2", 0, None, 0),
        ("1,1,4,2", 16, None, 0),
        ("1,1,4,2", 0, (2, 2), 0),
        ("1,1,4,2", 0, (2, 2), 1),
    ],
)
def test_greedy_vision_mode_equals_full_forward(mesh_shape, codes, grid, window):
    """Vision generation is argmax over the codes of a full forward pass of the vision head,
    with <eof> after every frame's codes and <eov> after the last frame's; with
    ``vision_codes`` only the first that many codes compete; with ``vision_grid`` each fed
    code carries the cell the full forward finds for it, with ``vision_window`` the codes
    generated before it in its frame."""
    mesh = None if mesh_shape is None else make_mesh(mesh_shape)
    attention = "ring" if mesh else "blockwise"
    grid_cfg = dict(vision_grid=grid, vision_window=window)
    model = create_model(debug_cfg(attention=attention, vision_codes=codes, **grid_cfg), mesh=mesh)
    # same seed: same weights
    full = create_model(debug_cfg(attention=attention, **grid_cfg), mesh=mesh)
    tokens, vision, lens = prompts()
    per_frame, frames = 4, 3
    out, _ = generate(
        model,
        tokens,
        vision,
        lens,
        key=jax.random.key(0),
        mode="vision",
        tokens_per_frame=per_frame,
        num_frames=frames,
    )
    steps = frames * (per_frame + 1)
    sp = 1 if mesh is None else mesh.shape["sp"]
    width = -(-(tokens.shape[1] + steps) // sp) * sp
    seqs = np.zeros((2, width), np.int32)
    vis = np.zeros((2, width), bool)
    seqs[:, : tokens.shape[1]], vis[:, : tokens.shape[1]] = tokens, vision
    forward = nnx.jit(lambda m, t, v: m(t, v)[1])
    n = np.asarray(lens).copy()
    for i in range(steps):
        logits = np.asarray(forward(full, jnp.asarray(seqs), jnp.asarray(vis)))
        if (i + 1) % (per_frame + 1) == 0:
            nxt = np.full(2, EOV_ID if i + 1 == steps else EOF_ID)
        else:
            nxt = logits[[0, 1], n - 1, : codes or EOF_ID].argmax(-1)  # codes, never a marker
        seqs[[0, 1], n], vis[[0, 1], n] = nxt, True
        n += 1
    ref = [seqs[r, int(lens[r]) : int(lens[r]) + steps].tolist() for r in range(2)]
    assert np.asarray(out).tolist() == ref


def test_cfg_scale_one_equals_conditional_generation():
    model = create_model(debug_cfg())
    tokens, vision, lens = prompts()
    uncond = jnp.zeros((2, 3), jnp.int32)
    kw = dict(key=jax.random.key(0), mode="vision", tokens_per_frame=4, num_frames=2)
    plain, _ = generate(model, tokens, vision, lens, **kw)
    guided, _ = generate(
        model,
        tokens,
        vision,
        lens,
        cfg_scale=1.0,
        uncond_tokens=uncond,
        uncond_vision_mask=jnp.zeros((2, 3), bool),
        uncond_len=3,
        **kw,
    )
    assert np.asarray(guided).tolist() == np.asarray(plain).tolist()
    stronger, _ = generate(
        model,
        tokens,
        vision,
        lens,
        cfg_scale=5.0,
        uncond_tokens=uncond,
        uncond_vision_mask=jnp.zeros((2, 3), bool),
        uncond_len=3,
        **kw,
    )
    assert np.asarray(stronger).tolist() != np.asarray(plain).tolist()


def test_bad_arguments_are_clear_errors():
    model = create_model(debug_cfg())
    tokens, vision, lens = prompts()
    with pytest.raises(ValueError, match="unknown generation mode 'audio'"):
        generate(model, tokens, vision, lens, key=jax.random.key(0), max_new_tokens=2, mode="audio")
    with pytest.raises(ValueError, match="cfg_scale needs"):
        generate(
            model, tokens, vision, lens, key=jax.random.key(0), max_new_tokens=2, cfg_scale=2.0
        )
    # Prompts that do not fit their lengths or masks: each was run, and answered wrongly (the
    # cache's empty slots attended, index -1 read, a narrower mask padded as text).
    width, rows = tokens.shape[1], tokens.shape[0]
    for bad, message in [
        (
            dict(prompt_len=[width + 1] * rows),
            rf"prompt_len must lie in \[1, {width}\].*got {width + 1}",
        ),
        (dict(prompt_len=0), rf"prompt_len must lie in \[1, {width}\].*got 0"),
        (dict(prompt_len=[1] * (rows + 1)), "prompt_len must be one length or one per row"),
        (dict(vision_mask=np.asarray(vision)[:, :3]), "vision_mask has shape"),
        (dict(tokens=np.asarray(tokens)[0]), r"tokens must be \[batch, width\]"),
    ]:
        args = dict(tokens=tokens, vision_mask=vision, prompt_len=lens) | bad
        if "tokens" in bad:
            args["vision_mask"] = np.asarray(vision)[0]
        with pytest.raises(ValueError, match=message):
            generate(model, **args, key=jax.random.key(0), max_new_tokens=2)
    with pytest.raises(TypeError, match="sampling must be a Sampling, got dict"):
        generate(model, tokens, vision, lens, key=jax.random.key(0), max_new_tokens=2,
                 sampling={"temperature": 0.5})  # fmt: skip


@pytest.mark.parametrize("mesh_shape,grid,window", [("1,1,4,2", (2, 4), 1)])  # cache: sp, tp
def test_chunked_prefill_equals_one_prefill(mesh_shape, grid, window):
    """The prompt prefilled in chunks (each attending the cache so far) gives the cache and the
    last hidden state of one prefill (1e-5), and the same greedy tokens; with ``vision_grid``
    and ``vision_window`` also where a chunk starts inside a frame."""
    from lwm.generate import prefill, prefill_chunked

    mesh = None if mesh_shape is None else make_mesh(mesh_shape)
    cfg = debug_cfg(
        attention="ring" if mesh else "blockwise", vision_grid=grid, vision_window=window
    )
    model = create_model(cfg, mesh=mesh)
    tokens, vision, lens = (np.array(x) for x in prompts())
    vision[:, 2:11] = True  # a frame of 8 codes across the chunk boundary at 8, then <eof>
    tokens[:, 10] = EOF_ID
    width = 24  # three chunks of 8
    tokens = np.pad(tokens, [(0, 0), (0, width - tokens.shape[1])])
    vision = np.pad(vision, [(0, 0), (0, width - vision.shape[1])])
    args = (jnp.asarray(tokens), jnp.asarray(vision), jnp.asarray(lens), 32)
    one = jax.jit(lambda *a: prefill(model, *a[:3], 32))(*args[:3])
    chunked = jax.jit(lambda *a: prefill_chunked(model, *a[:3], 32, 8))(*args[:3])
    np.testing.assert_allclose(np.asarray(chunked[1]), np.asarray(one[1]), atol=1e-5, rtol=1e-5)
    for a, b in zip(chunked[0], one[0], strict=True):  # keys, values of every prompt slot
        np.testing.assert_allclose(
            np.asarray(a)[:, :, :width], np.asarray(b)[:, :, :width], atol=1e-5
        )
    key = jax.random.key(0)
    out, _ = generate(model, tokens, vision, lens, key=key, max_new_tokens=5)
    got, _ = generate(model, tokens, vision, lens, key=key, max_new_tokens=5, prefill_chunk=8)
    assert np.asarray(got).tolist() == np.asarray(out).tolist()
    # a chunk longer than the prompts is cut to them: one chunk of their width, not one of
    # 10**6 tokens of padding (the padded prompts grew with the chunk)
    got, _ = generate(model, tokens, vision, lens, key=key, max_new_tokens=5, prefill_chunk=10**6)
    assert np.asarray(got).tolist() == np.asarray(out).tolist()


def test_prompt_width_never_pads_past_one_chunk_or_shard():
    from lwm.generate import prompt_width

    assert prompt_width(283, 1, None) == (283, None)
    assert prompt_width(283, 4, None) == (284, None)
    assert prompt_width(283, 1, 128) == (384, 128)  # whole chunks
    assert prompt_width(283, 1, 4096) == (283, 283)  # was 4096 tokens wide
    assert prompt_width(283, 4, 4096) == (284, 284)


@pytest.mark.parametrize("grid,window,chunk", [((4, 4), 1, 16), ((4, 4), 1, 512)])
def test_a_second_chat_turn_reuses_the_cache(grid, window, chunk):
    """Two turns of a conversation about a video, fed in chunks into one cache (the chunks on
    an sp-sharded cache: `test_chunked_prefill_equals_one_prefill`; here chunks of 16 cut the
    frames of 4x4 codes; chunks of 512, longer than the cache of 128, are cut to it): the
    second answer equals generation from a fresh prompt that holds both turns."""
    from data.tokens import TextCodec, qa_prompt, video_prompt_streams
    from lwm.chat import ChatSession, ContextFullError

    codec = TextCodec.load()
    model = create_model(
        debug_cfg(text_vocab_size=codec.vocab_size, vision_grid=grid, vision_window=window)
    )
    codes = np.random.default_rng(0).integers(0, 512, (2, 4, 4))
    chat = ChatSession(model, codec, codes, max_context=128, prefill_chunk=chunk, max_new_tokens=5)
    chat.ask("What colour is the square?")
    before = chat.history + list(chat.pending[0])  # the first turn, closed as training does
    second = chat.ask("Which way does it move?")
    prompt = before + codec.encode(qa_prompt("Which way does it move?"))
    _, video_vision = video_prompt_streams(codec, codes)
    vision = np.zeros((1, len(prompt)), bool)
    vision[0, : len(video_vision)] = video_vision
    stops = (codec.eos_id,)
    out, n = generate(
        model,
        np.asarray([prompt], np.int32),
        vision,
        np.asarray([len(prompt)], np.int32),
        key=jax.random.key(0),
        max_new_tokens=5,
        stop_tokens=stops,
    )
    fresh = np.asarray(out)[0, : int(n[0])].tolist()
    assert chat.history[len(prompt) :] == fresh
    ids = [x for x in fresh if x not in stops]
    assert second.text == codec.tokenizer.decode(ids, skip_special_tokens=True).strip()
    with pytest.raises(ContextFullError, match="but the context holds 128"):
        chat.ask("Tell me everything. " * 20)


def test_conversations_in_a_batch_equal_lwm_chat():
    """`VideoQA.answer_in_conversations` (`lwm eval qa --chat`): each video's questions asked
    in one conversation, turn k of all videos in one batch, answer as `ChatSession` asks them
    one after another (cut answers closed by EOS as the chat closes them)."""
    from data.tokens import TextCodec
    from lwm.chat import ChatSession
    from lwm.vision_qa import VideoQA

    codec = TextCodec.load()
    model = create_model(debug_cfg(text_vocab_size=codec.vocab_size))
    rng = np.random.default_rng(1)
    videos = {"a.mp4": rng.integers(0, 512, (2, 2, 2)), "b.mp4": rng.integers(0, 512, (3, 2, 2))}
    pairs = [
        ("a.mp4", "How many shapes move?"),
        ("b.mp4", "What colour is the square?"),
        ("a.mp4", "Which way does it move?"),
        ("a.mp4", "What appeared briefly?"),
        ("b.mp4", "What shape is the red one?"),
    ]
    qa = VideoQA(model, codec, None, max_new_tokens=5, batch_size=1, pad_to=16)
    qa._codes.update(videos)  # codes as if encoded by a VQGAN
    got = qa.answer_in_conversations(pairs)
    chats = {
        v: ChatSession(model, codec, c, max_context=128, prefill_chunk=16, max_new_tokens=5)
        for v, c in videos.items()
    }
    want = [chats[v].ask(q) for v, q in pairs]
    assert got == want
    assert any(a.cut for a in want) and len({a.text for a in want}) > 1
    # the first turn of each conversation is the question asked alone
    assert [got[0], got[1]] == qa.answer([pairs[0], pairs[1]])


def test_the_python_api_refuses_what_it_would_misread():
    """What the commands never pass but a script may: codes past the model's vision codes
    (answered as if learned), one (video, question) pair or one caption where a list is asked
    for (read item by item: one clip per character), one override string (one per character)."""
    from data.tokens import NUM_CODES, TextCodec
    from lwm.chat import ChatSession
    from lwm.config import ConfigError
    from lwm.text_to_video import VideoGenerator
    from lwm.vision_qa import VideoQA

    model, codec = create_model(debug_cfg()), TextCodec.load()
    codes = np.full((1, 2, 2), NUM_CODES, np.int32)
    with pytest.raises(ValueError, match=rf"codes must lie in \[0, {NUM_CODES}\).*got \["):
        ChatSession(model, codec, codes)
    with pytest.raises(TypeError, match="a list of \\(video, question\\) pairs, not one pair"):
        VideoQA(model, codec, None).answer(("v.mp4", "How many?"))
    with pytest.raises(TypeError, match="captions must be a list of captions"):
        VideoGenerator(model, codec, None).codes("A red circle.", frames=1)
    with pytest.raises(ConfigError, match="overrides must be a list of 'key=value' strings"):
        load_config("configs/debug.yaml", "model.num_layers=2")
