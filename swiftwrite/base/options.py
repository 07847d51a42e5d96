"""Every option, declared once: its name, type, default, metavar and the line `--help` shows.

OPTIONS are a run's settings: config.Config takes its fields from that table (same order, types and defaults) and
cli.generate its options; tests/test_options.py checks that the README's options table names each one. The tables
after it are each command's own options (where the text goes, how progress shows, what `bench` and `train-heads`
do), which are no settings of a run: not in Config, YAML or the environment.

A bool is a flag (`--raw`); a tuple is a repeatable option (`--ban A --ban B`) whose values are strings; a Path a
file or directory; every other option is read as a string and typed by config.typed, the code that reads YAML
and the environment too, so a bad value gets the same one-sentence error from every source. The comments say
why each default is what it is; config.Config.validate holds the ranges of a run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


# auto: on CUDA the Triton tree kernel for trees and flash-attn for prefill/decoding where installed, torch
# on the CPU; torch: torch everywhere; triton / flash: ask for that kernel (a notice and torch if it can't run).
# Here rather than in config.py: the lean forward checks its argument against it without importing the configuration
ATTENTIONS = ("auto", "torch", "triton", "flash")


@dataclass(frozen=True)
class Option:
    name: str  # a run's Config field (variable SWIFTWRITE_NAME) or a command's parameter; the flag: --name-with-dashes
    type: type  # bool, int, float, str, tuple (of strings, repeatable) or Path: what a value is turned into
    default: object  # None (a command's option only): not given, the command decides; its help says how
    metavar: str  # the value's placeholder in --help; "" for a flag
    help: str  # the line the command's --help shows

    def __post_init__(self):
        if self.default is not None and type(self.default) is not self.type:
            raise TypeError(f"option {self.name}: default {self.default!r} is not a {self.type.__name__}")
        if (self.type is bool) != (self.metavar == ""):
            raise ValueError(f"option {self.name}: a flag (bool) has no metavar, an option with a value has one")


OPTIONS: tuple[Option, ...] = (
    # alias, model directory, .gguf file or upstream id in the local HF cache
    Option("model", str, "smollm2-135m", "NAME",
           "Alias, model directory, .gguf file or Hugging Face id in the local cache."),
    # end-of-text is suppressed until then unless stop_at_eos
    Option("tokens", int, 2000, "N", "New tokens to write (default 2000)."),
    # wrap the brief in an instruction from prompts/
    Option("template", str, "none", "NAME", "novel | report | structured | revise | none."),
    # a text file the document draws on (a report's material, the draft `revise` rewrites), put in the prompt.
    # With one, the penalty and the n-gram suppression count only the written text: restating the source's
    # names and figures is the point, not a repeat. "" = none. Read once at `generate`, like an outline
    Option("source", str, "", "FILE",
           "A document to draw on (a report's material; the draft revise rewrites), put in the prompt."),
    # feed the prompt as plain text to continue, without the chat template
    Option("raw", bool, False, "", "Continue the prompt as plain text, no chat template."),
    # in [0, 2^32); the noise at position p depends only on (seed, p)
    Option("seed", int, 0, "S", "Sampling seed, 0 to 2^32-1 (default 0)."),
    # 0.7 with min-p 0.1 and the penalty over 256 tokens keeps the 135M default model's prose at its own level
    # for 10,000 tokens (README "Long texts"); at 1.0 it drifts into nonsense within a few hundred tokens. >= 0
    Option("temperature", float, 0.7, "T", "0 = greedy (default 0.7)."),
    Option("top_p", float, 1.0, "P", "Nucleus mass in (0, 1]; 1 = off (default)."),
    # keep tokens with p >= min_p * p_max (TokenSwift's long-form setting)
    Option("min_p", float, 0.1, "P", "In [0, 1]; 0 = off (default 0.1)."),
    Option("top_k", int, 0, "K", "0 = off (default)."),
    # theta of the contextual penalty (TokenSwift); >= 1
    Option("penalty", float, 1.2, "THETA", "Repetition penalty theta; 1 = off (default 1.2)."),
    # W: the penalty sees the last W tokens, prompt included. 256, not TokenSwift's 1,024: over 1,024 tokens every
    # common id is penalised, and the 135M default model turns to word salad within ~3,500 tokens; over 256 it
    # stays prose (README "Long texts", bench/dry_sweep.py). Verbatim loops of any period are DRY's job.
    Option("penalty_window", int, 256, "W", "Tokens the penalty looks back (default 256)."),
    # n-gram repetition suppression (DRY): a token that would continue a verbatim repeat of L >= allowed_length
    # tokens loses multiplier * base^(L - allowed_length) from its logit. Defaults from bench/dry_sweep.py
    Option("dry_multiplier", float, 0.8, "M", "N-gram repetition suppression strength; 0 = off (default 0.8)."),
    Option("dry_base", float, 1.75, "B", "Its growth per repeated token, >= 1 (default 1.75)."),
    Option("dry_allowed_length", int, 3, "N", "Repeats this long pass unpunished (default 3)."),
    # prompt included; 0 = the whole text (no edge to set a period)
    Option("dry_window", int, 0, "N", "Tokens it looks back; 0 = the whole text (default)."),
    # strings that end a match (a token whose text holds one is a breaker), comma-separated, \n \t \, \\
    # escapes; "none" = no breakers
    Option("dry_breakers", str, "\\n", "LIST",
           "Strings a repeat never runs across, comma-separated (default \\n); none = no breakers."),
    # a verbatim repeat of N tokens ends the run (checkpoint, exit 3); at least 16 (config.MIN_LOOP)
    Option("stop_on_loop", int, 0, "N", "End the run when the text repeats its last N tokens (>= 16) verbatim: "
           "checkpoint, exit status 3; 0 = off (default)."),
    Option("stop_at_eos", bool, False, "", "Stop at end-of-text instead of writing --tokens."),
    # token file flushed, state written atomically at each
    Option("chunk", int, 256, "N", "Tokens between checkpoints (default 256)."),
    # heads join "all" when trained ones match the model
    Option("draft", str, "all", "NAME", "none | recycling | ngram | heads | all (default all)."),
    # auto: fitted to this machine's cost curve
    Option("budget", str, "auto", "B", "Draft nodes per step: auto or 1..63."),
    # instead of the budgeted one
    Option("static_tree", bool, False, "", "Recycling: the paper's static 81-node tree."),
    # fused: heads read the verification pass's hidden state (one forward per step); two-pass: a separate
    # one-token draft forward over the partial draft cache first (the paper's scheme; one level deeper)
    Option("head_mode", str, "fused", "MODE", "Heads: fused (default) or two-pass (a draft forward first)."),
    # sinks + important + recent
    Option("draft_kv_budget", int, 4096, "N", "Two-pass: slots of the partial draft cache (default 4096)."),
    # 0 = the model's window. Past it the context is rebuilt
    Option("context", int, 0, "N", "Tokens the model attends to (default: the model's window)."),
    Option("device", str, "auto", "NAME", "auto | cpu | cuda."),
    # auto = bfloat16 on a GPU with bfloat16, float32 elsewhere (README "Half precision"); bfloat16/float16 write
    # another text than float32, and speculative output equals their own plain decoding by construction (exact.py)
    Option("dtype", str, "auto", "NAME", "auto | float32 | bfloat16 | float16."),
    # int8: per-channel symmetric, int4: groups of 32 asymmetric, both through torch's CPU kernels with bfloat16
    # activations (~4x / ~5x less to read per token than float32); quantized once into the model store. Not the
    # float model's text, but speculative output equals --draft none with the same weights. auto = float (README)
    Option("weights", str, "auto", "NAME",
           "auto | float | int8 | int4: quantized linear layers on the CPU (default auto = float)."),
    # auto: the faster of torch float and llama.cpp on the GGUF's own bits, timed at the first run on this machine
    # (backends.py); a run keeps the backend it was written with (another backend computes other last bits)
    Option("backend", str, "auto", "NAME", "auto | torch | ggml | ggml-repacked: our PyTorch forward or llama.cpp's "
           "kernels on the GGUF, repacked weights without drafts (default auto: the fastest here, measured once)."),
    # which attention kernels the forward uses
    Option("attention", str, "auto", "NAME", "auto | torch | triton | flash (GPU kernels; default auto)."),
    # replay the verification and decoding forwards from CUDA graphs (trees padded to 1, 2, 4 .. 64 nodes);
    # CUDA with the Triton kernel only. Off by default: on an H200 it halved a forward at 2K context and lost at
    # 8K, where single steps walk the cache in one program per head (docs/results/gpu.md)
    Option("cuda_graphs", bool, False, "", "Replay verification forwards from CUDA graphs (GPU)."),
    # torch CPU threads; 0 = torch's default, lowered while other processes keep cores busy and raised again
    # after, through counts a probe shows give the same bits (threads.py); N fixes the count
    Option("threads", int, 0, "N",
           "CPU threads; 0 = torch's default, fewer while other processes keep cores busy (same text)."),
    # tensor-parallel ranks: the model's heads and MLP columns split over N processes (GPUs, or CPU cores), each
    # holding 1/N of the weights and KV cache (parallel.py, ranks.py); 1 = one process. Another text in the last
    # bits of every sum, so a run is resumed with the degree it was written with
    Option("tp", int, 1, "N", "Tensor parallelism: split the model over N ranks (GPUs, or CPU cores), 1/N of the "
           "weights each; 1 = off (default)."),
    # a Markdown outline to follow: '## ' headings, optional notes under them, optional {tokens: N} budgets;
    # "" = none. Read once at `generate`; the run directory keeps the plan, so `resume` never reads it again
    Option("outline", str, "", "FILE",
           "Markdown outline to follow: '## ' headings, notes, {tokens: N} budgets."),
    # no outline given: the model writes one from the brief first (saved in the run directory)
    Option("plan", bool, False, "", "Let the model write the outline from the brief first, then the document."),
    # write the planned outline (stdout or --out) and stop, to edit and pass to --outline
    Option("plan_only", bool, False, "", "Write the planned outline and stop (edit it, pass it to --outline)."),
    # --plan: how many sections; 0 = one per 2,000 tokens of --tokens, 3 to 50
    Option("sections", int, 0, "N", "--plan: sections to plan (default: one per 2,000 tokens, 3 to 50)."),
    # past the window (run/memory.py): a block between the prompt and the recent text at every rebuild, and only
    # there, so a run that never passes its window writes what it always did. Read once at `generate`; the run
    # directory keeps each version with the token it took effect at (resume --memory adds one). "" = none
    Option("memory", str, "", "FILE", "Markdown notes the model keeps seeing past its window (the cast, the setting); "
           "resume --memory FILE takes an edited one from the next rebuild on."),
    # the text's own names: used >= 3 times outside the brief, most used first, each with the sentence that
    # introduced it, within a budget of 1/6 of the positions left (at most 192 tokens). Runs saved before it: none
    Option("recall", str, "names", "WHAT", "names (default): past the window, recall the people and places the text "
           "established; none = off."),
    # '## Name {keys: a, b}' entries; those whose keys the kept text names are pinned, most recently named first
    Option("lore", str, "", "FILE", "Markdown entries '## Name {keys: a, b}' shown past the window while the kept "
           "text names a key."),
    Option("lore_budget", int, 256, "N", "Tokens of lore entries at most (default 256)."),
    # banned phrases (bans.py): the text never contains one; where it would complete one, decoding goes back to where
    # it began and chooses again without that token. Matched in any case, after a space or not. Stored with the run
    # (the phrases of --ban-file included), so `resume` keeps enforcing them
    Option("ban", tuple, (), "PHRASE", "A phrase the text must never contain (repeatable); any case, after a space or not."),
    # banned patterns (base/patterns.py): a regular expression in the subset that can be matched token by token
    # (bounded: no * + {m,}); backtracking as for phrases. Case as written unless it starts with (?i)
    Option("ban_pattern", tuple, (), "REGEX", "A pattern the text must never match (repeatable): literal text, "
           "classes, ? {m,n} \\b | (); no * or +."),
    # one phrase per line (a line starting with `re:` a pattern), read once at `generate` and added to --ban's and
    # --ban-pattern's in the run's settings; "" = none
    Option("ban_file", str, "", "FILE", "A file of phrases to ban, one per line ('re:' before a pattern)."),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def defaults(table: tuple[Option, ...]) -> dict[str, object]:
    return {o.name: o.default for o in table}


# ---------------------------------------------------------------------------------------------------------
# The commands' own options

QUIET = Option("quiet", bool, False, "", "Print nothing but the text.")
NO_LIVE = Option("no_live", bool, False, "", "Plain progress lines instead of the live panel.")
STATS_JSON = Option("stats_json", Path, None, "FILE", "Write the final statistics as JSON.")
# Ray's own log lines (its core's, on standard error) are hidden from a batch on Ray: they say the same thing many times
RAY_VERBOSE = Option("verbose", bool, False, "", "With --ray: show Ray's own log lines too.")

# the plan (run/runplan.py) without running it: nothing loaded past the tokenizer, nothing written
DRY_RUN = Option("dry_run", bool, False, "", "Show what would run and why (memory, context, time) and stop.")
JSON = Option("json", bool, False, "", "With --dry-run: the plan as JSON on standard output.")

GENERATE: tuple[Option, ...] = (  # besides OPTIONS
    Option("out", Path, None, "FILE", "Write the text to this file instead of standard output."),
    Option("run_dir", Path, None, "DIR", "Run directory (default runs/<slug>-<time>)."),
    Option("config", Path, None, "FILE", "YAML file with options."),
    QUIET, NO_LIVE, STATS_JSON,
    DRY_RUN, JSON,
)

RESUME: tuple[Option, ...] = (
    # None: the run's own target; checked by Config.validate's range for --tokens
    Option("tokens", int, None, "N", "New total target of tokens (extends the run)."),
    Option("out", Path, None, "FILE", "Write the whole text (old and new) to this file."),
    Option("force", bool, False, "", "Resume even if the model or the number of ranks (--tp) changed."),
    # None: the ranks the run was written by (another sums in another order: another text)
    Option("tp", int, None, "N", "Tensor-parallel ranks (default: the run's own; another number needs --force)."),
    # None: the run's own setting. On a backend whose probe shows the same bits at every count the text is the same;
    # elsewhere resume says that another count continues it with other text
    Option("threads", int, None, "N", "CPU threads (default: the run's own setting; 0 = every core, fewer under load)."),
    QUIET, NO_LIVE, STATS_JSON,
    Option("edited", Path, None, "FILE", "Continue from this edited document in a new round; --tokens N then adds N "
           "tokens, appended to FILE (or --out)."),
    # the run's memory file edited: a new version, in effect from the next rebuild on (run/memory.py)
    Option("memory", Path, None, "FILE", "An edited memory: the model sees it from the next context rebuild on."),
    Option("ray", str, None, "ADDRESS", "A batch's directory only: continue it on the Ray cluster at ADDRESS, or on "
           "one started here (local), as batch --ray does."),
    RAY_VERBOSE,
)

BATCH: tuple[Option, ...] = (  # besides OPTIONS, which are every document's defaults (a line's own keys win)
    Option("out_dir", Path, None, "DIR", "The batch's directory: a manifest and a run directory per document (new; "
           "`swiftwrite resume DIR` continues it)."),
    Option("config", Path, None, "FILE", "YAML file with options, defaults for every document."),
    Option("parallel", str, "1", "N", "Documents written at a time, each in a process of its own with its share of "
           "the cores (default 1; capped at the cores); auto: the number that writes the most here, measured once."),
    Option("ray", str, None, "ADDRESS", "Write on the Ray cluster at ADDRESS (HOST:PORT, or auto), or on one started "
           "here (local); --parallel N is then the documents at a time on each node (pip install -e '.[ray]')."),
    RAY_VERBOSE, QUIET, NO_LIVE,
    Option("stats_json", Path, None, "FILE", "Write the batch's statistics, and each document's, as JSON."),
    DRY_RUN, JSON,
)

BENCH: tuple[Option, ...] = (
    # None: bench.DEFAULT, or bench.QUICK with --quick
    Option("methods", str, None, "LIST", "Comma-separated: llama.cpp, llama.cpp-lookup, hf, hf-lookup, none, "
           "recycling, recycling-static, ngram, heads, heads-2pass, all, all-2pass, all-b2..b16."),
    Option("settings", str, "greedy,sample", "LIST",
           "Comma-separated: greedy, sample (penalty on), greedy-nopenalty (default greedy,sample)."),
    Option("prompts", str, "creative", "LIST", "Comma-separated workloads (creative, grounded, revision, structured: "
           "a brief, a template and a source document from prompts/) or prompt files (default creative)."),
    Option("tokens", int, None, "N", "New tokens per run (default 2000; 300 with --quick)."),
    Option("repeats", int, 1, "N", "Repeats per method (median reported; default 1)."),
    Option("quick", bool, False, "", "hf, none and all, greedy only, 300 tokens: about two minutes."),
    Option("out", Path, None, "DIR", "Directory for bench.json and bench.md."),
)

MODELS_PULL: tuple[Option, ...] = (
    # auto: cuda where a GPU is here (the run's own --device rule); an alias's GGUF runs on llama.cpp on a CPU, its
    # upstream checkpoint in bfloat16 on a GPU
    Option("device", str, "auto", "NAME", "Where it will run: cpu pulls an alias's GGUF, cuda its upstream checkpoint "
           "(default auto: cuda when a GPU is here)."),
)

TRAIN_HEADS: tuple[Option, ...] = (  # train_heads.train takes its defaults from here
    Option("model", str, "smollm2-135m", "NAME",
           "The model to train heads for (any --model form; default smollm2-135m)."),
    Option("data", Path, None, "PATH", "Plain text file or directory of text files."),
    Option("self_distill", bool, False, "", "Let the model write its own training text first."),
    # held-out accuracy stopped improving by 300 on 45K tokens (800 gave no more)
    Option("steps", int, 400, "N", "Optimizer steps (default 400)."),
    # positions per step, each training all γ heads
    Option("batch", int, 512, "N", "Positions per step (default 512)."),
    # AdamW peak, linear warm-up then cosine; the paper's 5e-3 underfits at this data size
    Option("lr", float, 0.02, "LR", "Peak learning rate (default 0.02)."),
    # documents are cut at this length
    Option("seq_len", int, 2048, "N", "Longest sequence run through the model (default 2048)."),
    Option("out", Path, None, "FILE", "Heads file (default $SWIFTWRITE_HOME/heads/<model>.safetensors)."),
)
