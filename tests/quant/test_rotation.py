"""Seeded rotations: orthogonality, determinism, any d for Haar, Hadamard where MLX supports it."""
import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant.rotation import hadamard_signs, hadamard_supported, haar_rotation, make_rotation


@pytest.mark.parametrize("d", [2, 5, 64, 80, 96, 112, 128])
def test_haar_orthogonal_any_d(d):
    pi = np.array(haar_rotation(d, seed=3), dtype=np.float64)
    assert pi.shape == (d, d)
    np.testing.assert_allclose(pi @ pi.T, np.eye(d), atol=1e-5)


def test_same_seed_same_matrix_different_seed_differs():
    a, b, c = haar_rotation(96, 7), haar_rotation(96, 7), haar_rotation(96, 8)
    assert np.array_equal(np.array(a), np.array(b))
    assert not np.allclose(np.array(a), np.array(c))
    assert np.array_equal(np.array(hadamard_signs(64, 1)), np.array(hadamard_signs(64, 1)))
    assert set(np.unique(np.array(hadamard_signs(64, 1)))) == {-1.0, 1.0}


def test_haar_is_unbiased_sign_fix():
    # with the sign fix, E[Pi] = 0; without it the diagonal of Q from QR is biased positive
    diag = np.mean([np.trace(np.array(haar_rotation(8, s))) for s in range(200)])
    assert abs(diag) < 0.6


@pytest.mark.parametrize("kind,d", [("haar", 80), ("haar", 128), ("hadamard", 64), ("hadamard", 128),
                                    ("hadamard", 96), ("hadamard", 80), ("hadamard", 112)])
def test_apply_invert_roundtrip_and_matrix(kind, d):
    rot = make_rotation(d, seed=11, kind=kind)
    x = mx.array(np.random.default_rng(0).standard_normal((2, 3, d)).astype(np.float32))
    y = rot.apply(x)
    assert y.shape == x.shape and y.dtype == mx.float32
    np.testing.assert_allclose(np.array(rot.invert(y)), np.array(x), atol=1e-4)
    m = np.array(rot.matrix, dtype=np.float64)
    np.testing.assert_allclose(m @ m.T, np.eye(d), atol=1e-5)
    np.testing.assert_allclose(np.array(y), np.array(x) @ m.T, atol=1e-4)
    # norms preserved
    np.testing.assert_allclose(np.linalg.norm(np.array(y), axis=-1), np.linalg.norm(np.array(x), axis=-1),
                               rtol=1e-5)


def test_hadamard_support_and_error():
    assert hadamard_supported(128) and hadamard_supported(96) and hadamard_supported(80)
    assert not hadamard_supported(72) and not hadamard_supported(6)
    with pytest.raises(ValueError, match="hadamard"):
        make_rotation(72, 0, "hadamard")
    with pytest.raises(ValueError, match="rotation kind"):
        make_rotation(64, 0, "givens")
    with pytest.raises(ValueError, match="seed"):
        make_rotation(64, -1)
    with pytest.raises(ValueError, match="last dimension"):
        make_rotation(64, 0).apply(mx.zeros((3, 32)))


def test_none_is_the_identity_and_only_for_block_keys():
    """kind "none" (KEY_ROTATION_KINDS, CacheOptions.key_rotation) leaves vectors as they are; the TurboQuant
    quantizers, whose codebooks assume rotated coordinates, refuse it."""
    from veloxquant_mlx.quant.rotation import KEY_ROTATION_KINDS, ROTATION_KINDS
    from veloxquant_mlx.quant.turboquant_mse import TurboQuantMSE

    assert "none" in KEY_ROTATION_KINDS and "none" not in ROTATION_KINDS
    rot = make_rotation(48, seed=3, kind="none")
    x = mx.array(np.random.default_rng(1).standard_normal((2, 5, 48)).astype(np.float16))
    np.testing.assert_array_equal(np.array(rot.apply(x)), np.array(x.astype(mx.float32)))
    np.testing.assert_array_equal(np.array(rot.invert(x)), np.array(x.astype(mx.float32)))
    np.testing.assert_array_equal(np.array(rot.matrix), np.eye(48, dtype=np.float32))
    with pytest.raises(ValueError, match="rotation"):
        TurboQuantMSE(48, 4, rotation="none")
