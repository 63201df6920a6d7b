"""Plain-PyTorch Mixtral training throughput baseline for moeplan's C++ executor.

Hugging Face's MixtralForCausalLM, written out plainly, trained on random tokens with AdamW; prints
one JSON line (median step time, tokens/s, matmul GFLOP/s) to compare the executor with on the same
LibTorch and the same thread count, or on the same GPU (--device cuda). Run with the Python of the
PyTorch wheel the executor links ($MOEPLAN_TORCH_HOME/bin/python, scripts/install-torch)."""
import argparse, json, math, os, statistics, time
import torch
import torch.nn as nn
import torch.nn.functional as F

class RMSNorm(nn.Module):
    def __init__(self, h, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        xf = x.to(torch.float32)
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)

class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, self.nh, self.nkv, self.hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.theta, self.window = c["rope_theta"], c.get("sliding_window")

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.nkv, self.hd).transpose(1, 2)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32, device=x.device) / self.hd))
        emb = torch.outer(torch.arange(S, dtype=torch.float32, device=x.device), inv_freq).repeat(1, 2)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.nh // self.nkv, dim=1)  # GQA: repeat_kv
        v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
        masked = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)  # causal (+ sliding window if set)
        if self.window is not None:
            masked |= torch.ones(S, S, dtype=torch.bool, device=x.device).tril(-self.window)
        scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj(torch.matmul(probs, v).transpose(1, 2).reshape(B, S, -1))

class Expert(nn.Module):
    def __init__(self, H, I):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(I, H, bias=False), nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

class SparseMoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.E, self.k = c["num_experts"], c["experts_per_token"]
        self.gate = nn.Linear(c["hidden_size"], self.E, bias=False)
        self.experts = nn.ModuleList(Expert(c["hidden_size"], c["intermediate_size"]) for _ in range(self.E))

    def forward(self, x):
        B, S, H = x.shape
        x = x.reshape(-1, H)
        router_logits = self.gate(x)
        weights = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, selected = torch.topk(weights, self.k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(selected, self.E).permute(2, 1, 0)  # (E, k, tokens)
        for e, expert in enumerate(self.experts):
            slot, tok = torch.where(expert_mask[e])
            y = expert(x.index_select(0, tok)) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(x.dtype))
        return out.reshape(B, S, H), router_logits

class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.block_sparse_moe = SparseMoE(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        y, router_logits = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + y, router_logits

class MixtralForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c["num_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=c["initializer_range"])

    def forward(self, ids):
        x, all_logits = self.embed_tokens(ids), []
        for layer in self.layers:
            x, router_logits = layer(x)
            all_logits.append(router_logits)
        logits = self.lm_head(self.norm(x)).float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
        return loss + self.c["router_aux_loss_coef"] * load_balancing_loss(torch.cat(all_logits), self.c)

def load_balancing_loss(gate_logits, c):  # HF load_balancing_loss_func, no attention mask
    E, k = c["num_experts"], c["experts_per_token"]
    probs = F.softmax(gate_logits, dim=-1)
    _, selected = torch.topk(probs, k, dim=-1)
    tokens_per_expert = F.one_hot(selected, E).float().mean(dim=0)  # (k, E)
    return E * torch.sum(tokens_per_expert * probs.mean(dim=0).unsqueeze(0))

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def matmul_gflops(dtype, device, n=512, reps=20):
    if device.type == "cuda":
        n, reps = 8192, 50
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)  # warm-up
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    sync(device)
    return round(2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9, 3)

def main():
    default_model = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../profiles/models/mixtral-tiny.json")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, typ, default in [("--model", str, default_model), ("--seq-len", int, 256), ("--micro-batch", int, 8),
                               ("--steps", int, 20), ("--warmup", int, 3), ("--threads", int, 1), ("--seed", int, 1234)]:
        p.add_argument(flag, type=typ, default=default)
    # mixed: fp32 weights and AdamW, the forward under bf16 autocast (Hugging Face Trainer's bf16=True)
    p.add_argument("--precision", choices=["fp32", "bf16", "mixed"], default="fp32")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--grad-accumulation", type=int, default=1, help="micro-batches per optimizer step")
    a = p.parse_args()
    device = torch.device(a.device)
    with open(a.model) as f:
        c = json.load(f)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = MixtralForCausalLM(c)
    if a.precision == "bf16":
        model = model.to(torch.bfloat16)  # bf16 weights, grads and AdamW states; no autocast
    model = model.to(device)
    # mixtral-tiny: 2*V*H = 1,048,576 (embedding + lm_head); per layer: attention 16384+2*8192+16384
    # = 49,152, router 1,024, experts 8*3*128*256 = 786,432, norms 256 -> 836,864; x4 = 3,347,456;
    # final norm 128. Total 4,396,160.
    params = sum(t.numel() for t in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(a.seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "mixed")
    times, loss = [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(a.warmup + a.steps):
        batches = [torch.randint(0, c["vocab_size"], (a.micro_batch, a.seq_len), generator=gen).to(device)
                   for _ in range(a.grad_accumulation)]
        sync(device)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for ids in batches:
            with autocast:
                loss = model(ids) / a.grad_accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync(device)
        if step >= a.warmup:
            times.append(time.perf_counter() - t)
    gflops = {"fp32": matmul_gflops(torch.float32, device)}
    if a.precision != "fp32":
        gflops["bf16"] = matmul_gflops(torch.bfloat16, device)
    median = statistics.median(times)
    tokens = a.micro_batch * a.seq_len * a.grad_accumulation
    out = {"impl": "python", "precision": a.precision, "device": str(device), "threads": a.threads,
           "seq_len": a.seq_len, "micro_batch": a.micro_batch, "grad_accumulation": a.grad_accumulation,
           "steps": a.steps, "median_step_s": round(median, 6), "tokens_per_s": round(tokens / median, 2),
           "params": params, "final_loss": round(loss.item() * a.grad_accumulation, 6), "matmul_gflops": gflops}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    print(json.dumps(out))

if __name__ == "__main__":
    main()
