"""The negative twins' descriptions, stored so that naming a wrong rewrite builds no proof.

``{identity: {wrong rewrite: description}}`` for every wrong rewrite without a description of
its own whose negative twin of the same name describes it (:meth:`~circuitmath._registry.Identity.describe`
reads it). Written from the built proofs; tests/test_verdict_blame.py checks that it is still
what they say (and prints the entries that differ)."""

TWIN_DESCRIPTIONS: dict[str, dict[str, str]] = {
    'fold_layer_norm': {
        'scale_columns':
            "scale the reader's columns, not its rows (W * w[None, :], square W)",
        'bias_through_transpose':
            ("fold the LayerNorm bias through the reader's transpose, b W^T (square W, where W"
             ' @ b broadcasts)'),
        'drop_bias':
            'forget the LayerNorm bias term b W',
        'bias_through_gain':
            'push the LayerNorm bias through the folded weight: b diag(w) W',
    },
    'center_reading_weights': {
        'wrong_axis':
            "center over the reader's output axis (mean over m), not over d_model",
    },
    'center_writing_weights': {
        'W_O_over_d_head':
            ('center W_O [n_heads, d_head, d_model] over axis 1 (d_head), as `mean(dim=1)` in '
             'the source notes'),
        'shortformer_W_pos':
            ("center a shortformer W_pos, which is added to the norm's output (the query and "
             'key input)'),
    },
    'center_unembed': {
        'over_d_model':
            ('center W_U over d_model instead of the vocabulary: the shift (1/d)(y 1)(1^T W_U)'
             ' is not constant'),
    },
    'rescale_residual_stream': {
        'negative_scale':
            'scale by t < 0: sqrt(t^2) = |t|, so LNPre(t x) = -LNPre(x)',
    },
    'fold_rms_norm': {
        'gain_stored_as_w':
            "fold the stored w of a norm that applies 1 + w (Gemma): the identity's gain is 1 + w",
        'forget_W_gate':
            'fold the gain into W_in but not into W_gate of a gated MLP',
    },
    'shortformer_to_tables': {
        'naive_fold':
            'fold the gain into W and keep adding W_pos before it: positions get scaled by w',
    },
    'fold_value_biases': {
        'no_sum_over_heads':
            "fold only the first head's value bias term into b_O",
        'once_per_key_value_head':
            ('with grouped-query attention, fold each shared value bias through one W_O of its'
             ' group'),
    },
    'refactor_factored_attn_matrices': {
        'key_inverse_not_transposed':
            'change the keys by N^{-1} instead of N^{-T}',
    },
    'rms_norm_rotation': {
        'non_orthogonal':
            'rotate by an invertible G that is not orthogonal: |x G| != |x|',
        'not_transposed':
            'undo the rotation with Q instead of Q^T: RMSPre(x Q) Q != RMSPre(x)',
    },
    'layer_norm_rotation': {
        'generic_rotation':
            ('rotate an LNPre model by an orthogonal R that moves 1: centering does not '
             'commute with R'),
    },
    'rotate_residual_stream': {
        'non_orthogonal':
            'rotate by an invertible G that is not orthogonal, readers G^-1 W: the norms change',
        'forget_W_pos':
            'rotate W_E but not W_pos',
        'forget_writer_bias':
            'rotate W_O but not the output bias b_O',
        'readers_not_transposed':
            'readers Q W instead of Q^T W',
    },
    'slicegpt_route': {
        'skip_centering':
            'fold and rotate without centering the writes: RMSPre then sees |x Q| = |x|, not |x C|',
        'keep_layer_norm':
            'rotate the centered model but keep LNPre instead of switching to RMSPre',
    },
    'permute_heads': {
        'keys_not_permuted':
            'move the query heads and W_O, leave the keys in place',
        'output_not_permuted':
            "move every head's W_Q, W_K, W_V but not its W_O",
    },
    'permute_neurons': {
        'bias_not_permuted':
            "permute W_in's columns but not b_in",
        'out_not_permuted':
            "permute W_in but not W_out's rows",
    },
    'migrate_norm_scales': {
        'readers_unscaled':
            'divide the gain by s but leave the readers as they are',
        'wrong_way':
            "divide the readers' rows by s as well: diag(s)^-1 W instead of diag(s) W",
        'gate_unscaled':
            'scale every reader but the gate of a gated MLP',
        'bias_unscaled':
            'LayerNorm: divide the gain by s but not the bias',
    },
    'rotate_heads': {
        'per_query_head':
            ("grouped-query attention: a rotation per query head, U for head 1's W_O and U_2 "
             "for head 2's, the shared W_V by U"),
        'output_not_transposed':
            'W_O by U instead of U^T',
        'value_bias_unrotated':
            'rotate W_V but not b_V',
        'query_key_generic':
            'rotate queries and keys of a rotary model by a G that mixes rotary pairs',
        'key_unrotated':
            'rotate the queries but not the keys',
    },
    'scale_neurons': {
        'through_gate':
            ("scale the gate's columns instead of W_in's: act(z s) is no function of act(z) s "
             '(SiLU, GELU), so the gate becomes an unrelated g_s'),
        'out_not_divided':
            'scale W_in but leave W_out',
        'bias_not_scaled':
            'scale W_in but not b_in',
    },
    'process_weights': {
        'center_readers_before_fold':
            'center the readers first and fold the gain afterwards: diag(w) C W_V',
        'fold_gain_twice':
            'run the LayerNorm fold twice: the gain reaches each reader twice',
        'value_biases_before_ln_fold':
            'fold the value biases read before the LayerNorm fold, so b W_V never reaches b_O',
        'center_readers_behind_rms_norm':
            'center the readers of an RMSNorm model, whose output RMSPre(X) is not orthogonal to 1',
    },
    'tensor_product_action': {
        'no_transpose':
            'let B act from the right without transposing it: A X B',
    },
    'tensor_mixed_product': {
        'positions_reversed':
            'multiply the position factors in the other order: CA ⊗ BD',
    },
    'kronecker_vec': {
        'column_major':
            'vectorise column by column (Fortran order) with the same kron(A, B)',
    },
    'row_column_convention': {
        'row_product_in_paper_formula':
            "put TransformerLens's product W_1 W_2 into (I ⊗ ·)",
    },
    'attention_head_tensor_form': {
        'pattern_transposed':
            'mix positions with A^T (keys attending to queries)',
    },
    'multi_head_sum': {
        'stacked_in_wrong_order':
            'stack W_O in the other order than the result vectors',
    },
    'one_layer_path_expansion': {
        'direct_path_dropped':
            'forget the direct path I ⊗ W_U W_E',
    },
    'virtual_weights': {
        'previous_layer_only':
            'a layer reads only the layer before it',
    },
}
