"""Sample calls for every overload of the CPU autocast table, for the bitwise oracle test.

Each entry maps a canonical overload name to calls ``f(dt) -> output``; ``dt`` is the region's
dtype. Inputs are drawn from the global RNG, which the test seeds before each run, so the same
inputs reach ``torch.autocast`` and ``mixprec.autocast``. Calls name the op through ``torch.*``,
``Tensor.*`` and ``torch.ops.aten`` so every entry point is checked. Ops of the fp32 list get
low-precision inputs (so that the cast is visible in the result), the others float32 ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def r(*shape, dt=torch.float32, requires_grad=False):
    return torch.randn(*shape).to(dt).requires_grad_(requires_grad)


def pos(*shape, dt=torch.float32):
    return (torch.rand(*shape) + 0.5).to(dt)


def spd(n, dt=torch.float32):
    a = torch.randn(n, n)
    return (a @ a.T + n * torch.eye(n)).to(dt)


def _lstm_layer(dt):
    x = r(3, 2, 4)
    w0, w1 = r(16, 4), r(16, 4)
    b0, b1 = r(16), r(16)
    hx, cx = r(1, 2, 4), r(1, 2, 4)
    out = aten.mkldnn_rnn_layer(x, w0, w1, b0, b1, hx, cx, False, [], 2, 4, 1, True, False,
                                False, False)
    return out[:3]  # the 4th output is an uninitialised workspace


def _nmha(dt):
    q = r(2, 5, 8)
    return aten._native_multi_head_attention(q, q, q, 8, 2, r(24, 8), r(24), r(8, 8), r(8))


LOWER = {
    "conv1d": [lambda dt: torch.conv1d(r(2, 3, 8), r(4, 3, 3), r(4)),
               lambda dt: F.conv1d(r(2, 3, 8), r(4, 3, 3), stride=2)],
    "conv1d.padding": [lambda dt: torch.conv1d(r(2, 3, 8), r(4, 3, 3), padding="same")],
    "conv2d": [lambda dt: F.conv2d(r(1, 2, 5, 5), r(3, 2, 3, 3), r(3), padding=1)],
    "conv2d.padding": [lambda dt: F.conv2d(r(1, 2, 5, 5), r(3, 2, 3, 3), padding="valid")],
    "conv3d": [lambda dt: F.conv3d(r(1, 2, 4, 4, 4), r(2, 2, 2, 2, 2))],
    "conv3d.padding": [lambda dt: F.conv3d(r(1, 2, 4, 4, 4), r(2, 2, 3, 3, 3), padding="same")],
    "bmm": [lambda dt: torch.bmm(r(2, 3, 4), r(2, 4, 5)), lambda dt: r(2, 3, 4).bmm(r(2, 4, 5))],
    "mm": [lambda dt: torch.mm(r(3, 4), r(4, 5)), lambda dt: r(3, 4).mm(r(4, 5)),
           lambda dt: aten.mm(r(3, 4, dt=dt), r(4, 5))],
    "linalg_vecdot": [lambda dt: torch.linalg.vecdot(r(3, 4), r(3, 4))],
    "baddbmm": [lambda dt: torch.baddbmm(r(2, 3, 5), r(2, 3, 4), r(2, 4, 5), beta=0.5),
                lambda dt: r(2, 3, 5).baddbmm(r(2, 3, 4), r(2, 4, 5))],
    "addmm": [lambda dt: torch.addmm(r(5), r(3, 4), r(4, 5)),
              lambda dt: r(3, 5).addmm(r(3, 4), r(4, 5), alpha=2.0)],
    "_addmm_activation": [lambda dt: aten._addmm_activation(r(5), r(3, 4), r(4, 5), use_gelu=True)],
    "addbmm": [lambda dt: torch.addbmm(r(3, 5), r(2, 3, 4), r(2, 4, 5))],
    "linear": [lambda dt: F.linear(r(3, 4), r(5, 4), r(5)),
               lambda dt: F.linear(r(3, 4, requires_grad=True), r(5, 4, requires_grad=True))],
    "_convolution.deprecated": [lambda dt: aten._convolution.deprecated(
        r(1, 2, 5), r(3, 2, 3), r(3), [1], [0], [1], False, [0], 1, False, False, True)],
    "matmul": [lambda dt: torch.matmul(r(2, 3, 4), r(4, 5)), lambda dt: r(3, 4) @ r(4),
               lambda dt: r(3, 4).matmul(r(4, 2))],
    "conv_tbc": [lambda dt: torch.conv_tbc(r(5, 2, 3), r(3, 3, 4), r(4))],
    "mkldnn_rnn_layer": [_lstm_layer],
    "conv_transpose1d": [lambda dt: F.conv_transpose1d(r(1, 2, 5), r(2, 3, 3), r(3))],
    "conv_transpose2d.input": [lambda dt: F.conv_transpose2d(r(1, 2, 4, 4), r(2, 3, 3, 3))],
    "conv_transpose3d.input": [lambda dt: F.conv_transpose3d(r(1, 2, 3, 3, 3), r(2, 2, 2, 2, 2))],
    "prelu": [lambda dt: F.prelu(r(2, 3, 4), r(3)), lambda dt: torch.prelu(r(2, 3), r(1))],
    "scaled_dot_product_attention": [
        lambda dt: F.scaled_dot_product_attention(r(1, 2, 4, 8), r(1, 2, 4, 8), r(1, 2, 4, 8)),
        lambda dt: F.scaled_dot_product_attention(r(1, 2, 4, 8), r(1, 2, 4, 8), r(1, 2, 4, 8),
                                                  is_causal=True)],
    "_native_multi_head_attention": [_nmha],
}

FP32 = {
    "avg_pool3d": [lambda dt: F.avg_pool3d(r(1, 2, 4, 4, 4, dt=dt), 2)],
    "binary_cross_entropy": [lambda dt: F.binary_cross_entropy(torch.rand(4).to(dt), torch.rand(4).to(dt))],
    "grid_sampler": [lambda dt: aten.grid_sampler(r(1, 2, 4, 4, dt=dt), r(1, 3, 3, 2, dt=dt), 0, 0, False)],
    "polar": [lambda dt: torch.polar(pos(3, dt=dt), r(3, dt=dt))],
    "prod": [lambda dt: torch.prod(r(4, dt=dt)), lambda dt: r(4, dt=dt).prod()],
    "prod.dim_int": [lambda dt: torch.prod(r(3, 4, dt=dt), 1)],
    "quantile": [lambda dt: torch.quantile(r(8, dt=dt), r(3).sigmoid().to(dt))],
    "quantile.scalar": [lambda dt: torch.quantile(r(8, dt=dt), 0.3)],
    "nanquantile": [lambda dt: torch.nanquantile(r(8, dt=dt), torch.tensor([0.2, 0.8]).to(dt))],
    "nanquantile.scalar": [lambda dt: r(8, dt=dt).nanquantile(0.5)],
    "stft": [lambda dt: aten.stft(r(32, dt=dt), 8, 4, None, None, False, None, True)],
    "stft.center": [lambda dt: torch.stft(r(32, dt=dt), 8, return_complex=True)],
    "cdist": [lambda dt: torch.cdist(r(3, 4, dt=dt), r(5, 4, dt=dt))],
    "grid_sampler_2d": [lambda dt: F.grid_sample(r(1, 2, 4, 4, dt=dt), r(1, 3, 3, 2, dt=dt), align_corners=False)],
    "_grid_sampler_2d_cpu_fallback": [lambda dt: aten._grid_sampler_2d_cpu_fallback(
        r(1, 2, 4, 4, dt=dt), r(1, 3, 3, 2, dt=dt), 0, 0, False)],
    "grid_sampler_3d": [lambda dt: F.grid_sample(r(1, 2, 3, 3, 3, dt=dt), r(1, 2, 2, 2, 3, dt=dt), align_corners=True)],
    "trace": [lambda dt: torch.trace(r(4, 4, dt=dt))],
    "view_as_complex": [lambda dt: torch.view_as_complex(r(3, 2, dt=dt))],
    "cholesky": [lambda dt: torch.cholesky(spd(3, dt=dt))],
    "cholesky_inverse": [lambda dt: torch.cholesky_inverse(torch.linalg.cholesky(spd(3)).to(dt))],
    "cholesky_solve": [lambda dt: torch.cholesky_solve(r(3, 2, dt=dt), torch.linalg.cholesky(spd(3)).to(dt))],
    "inverse": [lambda dt: torch.inverse(spd(3, dt=dt))],
    "lu_solve": [lambda dt: torch.lu_solve(r(3, 2, dt=dt), *[x.to(dt) if x.is_floating_point() else x for x in torch.linalg.lu_factor(spd(3))])],
    "orgqr": [lambda dt: torch.orgqr(*[x.to(dt) for x in torch.geqrf(r(4, 3))])],
    "ormqr": [lambda dt: torch.ormqr(*[x.to(dt) for x in torch.geqrf(r(4, 3))], r(4, 2, dt=dt))],
    "pinverse": [lambda dt: torch.pinverse(r(3, 4, dt=dt))],
    "max_pool3d": [lambda dt: torch.max_pool3d(r(1, 2, 4, 4, 4, dt=dt), 2)],
    "max_unpool2d": [lambda dt: F.max_unpool2d(r(1, 1, 2, 2, dt=dt), torch.tensor([[[[0, 3], [8, 11]]]]), 2)],
    "max_unpool3d": [lambda dt: aten.max_unpool3d(r(1, 1, 1, 1, 2, dt=dt), torch.tensor([[[[[0, 3]]]]]), [2, 2, 2], [1, 1, 1], [0, 0, 0])],
    "adaptive_avg_pool3d": [lambda dt: F.adaptive_avg_pool3d(r(1, 2, 4, 4, 4, dt=dt), 2)],
    "reflection_pad1d": [lambda dt: F.pad(r(1, 2, 5, dt=dt), (2, 1), mode="reflect")],
    "reflection_pad2d": [lambda dt: F.pad(r(1, 2, 4, 4, dt=dt), (1, 1, 2, 0), mode="reflect")],
    "replication_pad1d": [lambda dt: F.pad(r(1, 2, 5, dt=dt), (2, 1), mode="replicate")],
    "replication_pad2d": [lambda dt: F.pad(r(1, 2, 4, 4, dt=dt), (1, 1, 2, 0), mode="replicate")],
    "replication_pad3d": [lambda dt: F.pad(r(1, 1, 2, 3, 3, dt=dt), (1, 1, 1, 0, 0, 1), mode="replicate")],
    "mse_loss": [lambda dt: F.mse_loss(r(4, dt=dt), r(4, dt=dt))],
    "cosine_embedding_loss": [lambda dt: F.cosine_embedding_loss(r(3, 4, dt=dt), r(3, 4, dt=dt), torch.tensor([1, -1, 1]))],
    "nll_loss": [lambda dt: F.nll_loss(r(3, 5, dt=dt).log_softmax(-1), torch.tensor([1, 0, 4]))],
    "nll_loss2d": [lambda dt: F.nll_loss(r(2, 3, 2, 2, dt=dt), torch.randint(0, 3, (2, 2, 2)))],
    "hinge_embedding_loss": [lambda dt: F.hinge_embedding_loss(r(4, dt=dt), torch.tensor([1, -1, 1, -1]))],
    "poisson_nll_loss": [lambda dt: F.poisson_nll_loss(r(4, dt=dt), pos(4, dt=dt))],
    "smooth_l1_loss": [lambda dt: F.smooth_l1_loss(r(4, dt=dt), r(4, dt=dt))],
    "cross_entropy_loss": [lambda dt: F.cross_entropy(r(3, 5, dt=dt), torch.tensor([1, 0, 4])),
                           lambda dt: F.cross_entropy(r(3, 5, dt=dt), r(3, 5).softmax(-1), label_smoothing=0.1)],
    "l1_loss": [lambda dt: F.l1_loss(r(4, dt=dt), r(4, dt=dt))],
    "huber_loss": [lambda dt: F.huber_loss(r(4, dt=dt), r(4, dt=dt))],
    "margin_ranking_loss": [lambda dt: F.margin_ranking_loss(r(4, dt=dt), r(4, dt=dt), torch.tensor([1., -1, 1, -1]))],
    "soft_margin_loss": [lambda dt: F.soft_margin_loss(r(4, dt=dt), torch.tensor([1., -1, 1, -1]).to(dt))],
    "triplet_margin_loss": [lambda dt: F.triplet_margin_loss(r(3, 4, dt=dt), r(3, 4, dt=dt), r(3, 4, dt=dt))],
    "multi_margin_loss": [lambda dt: F.multi_margin_loss(r(3, 5, dt=dt), torch.tensor([1, 0, 4]))],
    "ctc_loss.IntList": [lambda dt: torch.ctc_loss(r(6, 2, 4, dt=dt).log_softmax(-1), torch.tensor([[1, 2], [3, 1]]), [6, 5], [2, 2])],
    "ctc_loss.Tensor": [lambda dt: F.ctc_loss(r(6, 2, 4, dt=dt).log_softmax(-1), torch.tensor([[1, 2], [3, 1]]),
                                              torch.tensor([6, 5]), torch.tensor([2, 2]))],
    "kl_div": [lambda dt: F.kl_div(r(4, dt=dt).log_softmax(-1), r(4, dt=dt).softmax(-1), reduction="batchmean")],
    "multilabel_margin_loss": [lambda dt: F.multilabel_margin_loss(r(2, 4, dt=dt), torch.tensor([[3, 0, -1, 1], [0, 1, 2, -1]]))],
    "binary_cross_entropy_with_logits": [lambda dt: F.binary_cross_entropy_with_logits(r(4, dt=dt), torch.rand(4).to(dt))],
    "fft_fft": [lambda dt: torch.fft.fft(r(8, dt=dt))],
    "fft_ifft": [lambda dt: torch.fft.ifft(r(8, dt=dt))],
    "fft_fft2": [lambda dt: torch.fft.fft2(r(4, 4, dt=dt))],
    "fft_ifft2": [lambda dt: torch.fft.ifft2(r(4, 4, dt=dt))],
    "fft_fftn": [lambda dt: torch.fft.fftn(r(2, 4, 4, dt=dt))],
    "fft_ifftn": [lambda dt: torch.fft.ifftn(r(2, 4, 4, dt=dt))],
    "fft_rfft": [lambda dt: torch.fft.rfft(r(8, dt=dt))],
    "fft_irfft": [lambda dt: torch.fft.irfft(r(8, dt=dt))],
    "fft_rfft2": [lambda dt: torch.fft.rfft2(r(4, 4, dt=dt))],
    "fft_irfft2": [lambda dt: torch.fft.irfft2(r(4, 4, dt=dt))],
    "fft_rfftn": [lambda dt: torch.fft.rfftn(r(2, 4, 4, dt=dt))],
    "fft_irfftn": [lambda dt: torch.fft.irfftn(r(2, 4, 4, dt=dt))],
    "fft_hfft": [lambda dt: torch.fft.hfft(r(8, dt=dt))],
    "fft_ihfft": [lambda dt: torch.fft.ihfft(r(8, dt=dt))],
    "linalg_cond": [lambda dt: torch.linalg.cond(spd(3, dt=dt))],
    "linalg_cond.p_str": [lambda dt: torch.linalg.cond(spd(3, dt=dt), "fro")],
    "linalg_matrix_rank": [lambda dt: aten.linalg_matrix_rank(r(3, 4, dt=dt), 1e-3)],
    "linalg_matrix_rank.tol_tensor": [lambda dt: aten.linalg_matrix_rank.tol_tensor(r(3, 4, dt=dt), torch.tensor(1e-3).to(dt))],
    "linalg_matrix_rank.atol_rtol_tensor": [lambda dt: torch.linalg.matrix_rank(r(3, 4, dt=dt), atol=torch.tensor(1e-3))],
    "linalg_matrix_rank.atol_rtol_float": [lambda dt: torch.linalg.matrix_rank(r(3, 4, dt=dt), atol=1e-3, rtol=0.0)],
    "linalg_solve": [lambda dt: torch.linalg.solve(spd(3, dt=dt), r(3, 2, dt=dt))],
    "linalg_cholesky": [lambda dt: torch.linalg.cholesky(spd(3, dt=dt))],
    "linalg_svdvals": [lambda dt: torch.linalg.svdvals(r(3, 4, dt=dt))],
    "linalg_eigvals": [lambda dt: torch.linalg.eigvals(spd(3, dt=dt))],
    "linalg_eigvalsh": [lambda dt: torch.linalg.eigvalsh(spd(3, dt=dt))],
    "linalg_inv": [lambda dt: torch.linalg.inv(spd(3, dt=dt))],
    "linalg_householder_product": [lambda dt: torch.linalg.householder_product(*[x.to(dt) for x in torch.geqrf(r(4, 3))])],
    "linalg_tensorinv": [lambda dt: torch.linalg.tensorinv(spd(4, dt=dt).reshape(4, 2, 2), ind=1)],
    "linalg_tensorsolve": [lambda dt: torch.linalg.tensorsolve(spd(4, dt=dt).reshape(2, 2, 4), r(2, 2, dt=dt))],
    "fake_quantize_per_tensor_affine": [lambda dt: torch.fake_quantize_per_tensor_affine(r(4, dt=dt), 0.1, 0, 0, 255)],
    "geqrf": [lambda dt: torch.geqrf(r(4, 3, dt=dt))],
    "_lu_with_info": [lambda dt: aten._lu_with_info(spd(3, dt=dt))],
    "qr": [lambda dt: torch.qr(r(4, 3, dt=dt))],
    "svd": [lambda dt: torch.svd(r(4, 3, dt=dt))],
    "triangular_solve": [lambda dt: torch.triangular_solve(r(3, 2, dt=dt), spd(3, dt=dt).triu())],
    "fractional_max_pool2d": [lambda dt: aten.fractional_max_pool2d(r(1, 1, 6, 6, dt=dt), [2, 2], [3, 3], torch.full((1, 1, 2), 0.5).to(dt))],
    "fractional_max_pool3d": [lambda dt: aten.fractional_max_pool3d(r(1, 1, 4, 4, 4, dt=dt), [2, 2, 2], [2, 2, 2], torch.full((1, 1, 3), 0.5).to(dt))],
    "adaptive_max_pool3d": [lambda dt: F.adaptive_max_pool3d(r(1, 1, 4, 4, 4, dt=dt), 2)],
    "multilabel_margin_loss_forward": [lambda dt: aten.multilabel_margin_loss_forward(r(2, 4, dt=dt), torch.tensor([[3, 0, -1, 1], [0, 1, 2, -1]]), 1)],
    "linalg_qr": [lambda dt: torch.linalg.qr(r(4, 3, dt=dt))],
    "linalg_cholesky_ex": [lambda dt: torch.linalg.cholesky_ex(spd(3, dt=dt))],
    "linalg_svd": [lambda dt: torch.linalg.svd(r(4, 3, dt=dt), full_matrices=False)],
    "linalg_eig": [lambda dt: torch.linalg.eig(spd(3, dt=dt))],
    "linalg_eigh": [lambda dt: torch.linalg.eigh(spd(3, dt=dt))],
    "linalg_lstsq": [lambda dt: torch.linalg.lstsq(r(4, 3, dt=dt), r(4, 2, dt=dt), driver="gels")],
    "linalg_inv_ex": [lambda dt: torch.linalg.inv_ex(spd(3, dt=dt))],
}

PROMOTE = {
    "stack": [lambda dt: torch.stack([r(3, dt=dt), r(3)]), lambda dt: torch.stack([r(3, dt=dt), r(3, dt=dt)]),
              lambda dt: torch.stack([r(3, dt=dt), r(3, dt=torch.float64)])],
    "cat": [lambda dt: torch.cat([r(2, 3, dt=dt), r(1, 3)]), lambda dt: torch.cat((r(3, dt=dt), r(3, dt=dt)))],
    "index_copy": [lambda dt: torch.index_copy(r(4, 3), 0, torch.tensor([0, 2]), r(2, 3, dt=dt)),
                   lambda dt: r(4, 3, dt=dt).index_copy(0, torch.tensor([1, 3]), r(2, 3, dt=dt))],
}

SAMPLES = {**LOWER, **FP32, **PROMOTE}


def flatten(out):
    """The tensors of an op's output, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flatten(o)]
    return []
