"""Alekseenko et al. (004_): Table 2 most-distant sites and clusters, Table 6 -> Table 7."""

import numpy as np
import pytest

from fedmed.algorithms.clustering import farthest_split, most_distant_site
from fedmed.algorithms.heterogeneity import d_emd, emd_summary, select_max_feature


def sym(upper, n):
    D = np.zeros((n, n))
    D[np.triu_indices(n, 1)] = upper
    return D + D.T


# Table 2 (clients 1..N -> indices 0..N-1)
FETS_EMD = sym([3.60, 7.87, 13.91, 1.75, 4.55, 2.98], 4)
FETS_EUC = sym([23, 49, 63, 30, 47, 22], 4)
PROSTATE_EMD = sym([1.24, 3.01, 8.54, 2.70, 11.05, 4.31], 4)
PROSTATE_EUC = sym([51, 83, 122, 60, 98, 59], 4)
KITS_EMD = sym([0.92, 1.45, 2.46, 13.86, 1.03, 2.37, 12.55, 1.15, 11.03, 4.89], 5)
KITS_EUC = sym([936, 1268, 2743, 1207, 844, 2211, 600, 1602, 303, 1548], 5)


@pytest.mark.parametrize(
    "D, distant, clusters",
    [
        (FETS_EMD, 0, [[0, 1], [2, 3]]),  # "client1 as the most distant"; FedAvg{1,2}{3,4}
        (FETS_EUC, 0, [[0, 1], [2, 3]]),
        (PROSTATE_EMD, 3, [[0, 1], [2, 3]]),  # client4; FedAvg{1,2}{3,4}
        (PROSTATE_EUC, 3, [[0, 1], [2, 3]]),
        (KITS_EMD, 4, [[0, 1, 2], [3, 4]]),  # client5; FedAvgEMD:{1,2,3}{4,5}
        (KITS_EUC, 3, [[0, 1], [2, 3, 4]]),  # client4; FedAvgEUC:{1,2}{3,4,5}
    ],
)
def test_table2_most_distant_and_table4_clusters(D, distant, clusters):
    assert most_distant_site(D) == distant
    out = farthest_split(D)
    assert out["most_distant"] == distant
    got = sorted(out["clusters"], key=lambda c: c[0])
    assert got == clusters
    assert distant in out["clusters"][1]


def test_printed_algorithm_disagrees_on_kits_emd():
    # The literal box keeps moving until |C1| == 2, giving {1,2}{3,4,5} instead of the reported {1,2,3}{4,5}.
    out = farthest_split(KITS_EMD, rule="printed")
    assert sorted(out["clusters"], key=lambda c: c[0]) == [[0, 1], [2, 3, 4]]
    # For four clients both readings agree.
    assert farthest_split(FETS_EMD, rule="printed")["clusters"] == farthest_split(FETS_EMD)["clusters"]


def test_column_sums_of_table2():
    np.testing.assert_allclose(FETS_EUC.sum(0), [135, 100, 101, 132])
    np.testing.assert_allclose(KITS_EUC.sum(0), [6154, 4591, 4017, 8104, 3658])



def test_table2_printed_emd_sums_are_not_column_sums_but_name_the_same_site():
    """Table 2 prints a "Sum" row under each matrix; 7 of its 13 EMD sums are not the column sums of the printed
    matrix (the EUC ones are). fedmed sums the columns (Eq. 3); the most distant site is the same either way."""
    printed = {"fets": ([25.38, 6.30, 4.73, 21.45], FETS_EMD), "prostate": ([12.79, 13.75, 7.02, 23.90], PROSTATE_EMD),
               "kits": ([18.70, 15.95, 13.21, 8.40, 42.34], KITS_EMD)}
    off = 0
    for name, (sums, D) in printed.items():
        off += int((np.abs(D.sum(0) - np.asarray(sums)) > 0.015).sum())
        assert most_distant_site(D) == int(np.argmax(sums)), name
    assert off == 7

# Table 6 (as printed, including its asymmetric 3.07 / 3.16 entry)
FLAIR = np.array([[0, .33, .32, .27], [.33, 0, .34, 1.45], [.32, .34, 0, .86], [.27, 1.45, .86, 0]])
ET = np.array([[0, 6.87, 15.42, 27.55], [6.87, 0, 3.07, 7.40], [15.42, 3.16, 0, 5.18], [27.55, 7.40, 5.18, 0]])
TABLE7 = np.array([[0, 3.60, 7.87, 13.91], [3.60, 0, 1.70, 4.43], [7.87, 1.75, 0, 3.02], [13.91, 4.43, 3.02, 0]])


def test_table6_to_table7():
    intensity = {"T2": FLAIR * 0.393 / 0.595, "T1": FLAIR * 0.247 / 0.595, "T1C": FLAIR * 0.290 / 0.595, "FLAIR": FLAIR}
    labels = {"WT": ET * 0.935 / 10.96, "TC": ET * 0.561 / 10.96, "ET": ET}
    out = d_emd(intensity, labels)
    assert out["max_intensity"] == "FLAIR" and out["max_label"] == "ET"
    # Table 7 is printed to 2 decimals; 1.705 and 4.425 round half-down there.
    np.testing.assert_allclose(out["D"], TABLE7, atol=0.0051)
    assert most_distant_site(out["D"]) == 0


def test_emd_summary_reproduces_flair_value():
    # Appendix C: EMD_FLAIR = 0.595 is the mean of Table 6's FLAIR pairwise EMDs.
    assert emd_summary(FLAIR) == pytest.approx(0.595, abs=1e-9)
    best, summaries = select_max_feature({"T2": np.full((2, 2), .393) - np.eye(2) * .393, "FLAIR": FLAIR})
    assert best == "FLAIR"
