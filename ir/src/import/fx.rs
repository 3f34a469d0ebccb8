//! The default exporter's record of where each node came from: the FX node of the exported
//! program (`pkg.torch.onnx.fx_node` node metadata), `%out : [...] =
//! call_function[target=torch.ops.aten.add.Tensor](args = (%a, %b), kwargs = {})`. It
//! keeps what ONNX cannot state: a `detach()` ([`super::detached`]), an embedding's
//! padding index ([`super::padding`]).

use onnx_protobuf::NodeProto;

/// The node metadata in which the default exporter records the FX node a node came from.
pub const FX_NODE: &str = "pkg.torch.onnx.fx_node";

/// The FX node `node` came from, if its exporter recorded one.
pub fn fx_node(node: &NodeProto) -> Option<&str> {
    node.metadata_props.iter().find(|p| p.key == FX_NODE).map(|p| p.value.as_str())
}

/// The operator an FX node calls: `aten.embedding.default`.
pub fn fx_target(fx: &str) -> Option<&str> {
    let (_, rest) = fx.split_once("target=torch.ops.")?;
    rest.split_once(']').map(|(target, _)| target)
}

/// An FX node's arguments: the text between `(args = (` and `), kwargs = {`, and the
/// keyword arguments after it.
pub fn fx_arguments(fx: &str) -> Option<(&str, &str)> {
    let (_, rest) = fx.split_once("](args = (")?;
    let (args, kwargs) = rest.rsplit_once("), kwargs = {")?;
    Some((args, kwargs.strip_suffix("})").unwrap_or(kwargs)))
}

/// The FX values (`%name`) a piece of argument text names, in order.
pub fn fx_values(text: &str) -> impl Iterator<Item = &str> {
    text.split('%').skip(1).map(|s| s.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).next().unwrap_or(""))
}

/// The top-level arguments of an FX argument list (commas inside brackets split nothing).
pub fn top_level(args: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0i32, 0, Vec::new());
    for (i, c) in args.char_indices() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(args[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    let last = args[start..].trim();
    if !last.is_empty() {
        out.push(last);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_split_at_the_top_level_only() {
        assert_eq!(top_level("%a, [%b, %c], 1"), ["%a", "[%b, %c]", "1"]);
        assert_eq!(fx_values("%a, [%b_2, %c], 1").collect::<Vec<_>>(), ["a", "b_2", "c"]);
    }

    #[test]
    fn the_target_is_the_aten_operator() {
        let fx = "%embedding : [num_users=1] = call_function[target=torch.ops.aten.embedding.default](args = (%p_w, %ids, 1), kwargs = {})";
        assert_eq!(fx_target(fx), Some("aten.embedding.default"));
        assert_eq!(fx_arguments(fx), Some(("%p_w, %ids, 1", "")));
    }
}
