"""Plain fp64 reference of the loss, written row by row from Eq. 3 of the paper.

    Pr(x in class R) = sum_{i in R and N} w_i f(x, c_i) / sum_{j in N} w_j f(x, c_j)
    loss = -ln Pr,   f(x, c) = exp(-||x - c||^2 / (2 sigma^2))

Numerator and denominator are each computed with their own max shift (the same sums, just
scaled) so that the reference stays finite where far-away centres would underflow. Every
quantity is an ordinary differentiable torch expression, so autograd gives the reference
gradients for emb, centres, weights and sigma.
"""
import torch


def reference_loss_rows(emb, labels, centres, centre_labels, neighbours, weights=None,
                        sigma=1.0):
    """Returns (per-row loss (B,) fp64, valid (B,) bool); rows with no positive give 0."""
    B = emb.shape[0]
    emb = emb.double()
    centres = centres.double()
    if weights is not None:
        weights = weights.double()
    sigma = sigma.double() if isinstance(sigma, torch.Tensor) else torch.tensor(float(sigma),
                                                                                dtype=torch.float64)
    rows, valid = [], []
    for b in range(B):
        log_terms, positive = [], []
        for j in neighbours[b].tolist():
            if j < 0:
                continue
            w = 1.0 if weights is None else weights[j]
            if weights is not None and float(w.detach()) == 0.0:
                continue  # a zero weight removes the centre
            d = ((emb[b] - centres[j]) ** 2).sum()
            log_terms.append(torch.log(torch.as_tensor(w, dtype=torch.float64)) - d / (2 * sigma ** 2))
            positive.append(int(centre_labels[j]) == int(labels[b]))
        pos = [t for t, p in zip(log_terms, positive, strict=True) if p]
        if not pos:
            rows.append(emb.new_zeros(()) + 0.0 * emb[b].sum())
            valid.append(False)
            continue
        all_t = torch.stack(log_terms)
        pos_t = torch.stack(pos)
        m_all, m_pos = all_t.max().detach(), pos_t.max().detach()
        den = torch.exp(all_t - m_all).sum()
        num = torch.exp(pos_t - m_pos).sum()
        rows.append(-(torch.log(num) + m_pos - torch.log(den) - m_all))
        valid.append(True)
    return torch.stack(rows), torch.tensor(valid, dtype=torch.bool)


def reference_loss(emb, labels, centres, centre_labels, neighbours, weights=None, sigma=1.0,
                   reduction="mean"):
    rows, valid = reference_loss_rows(emb, labels, centres, centre_labels, neighbours, weights,
                                      sigma)
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / max(int(valid.sum()), 1)
