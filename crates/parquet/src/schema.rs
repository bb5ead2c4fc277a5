//! The schema as JSON sees it: each leaf column's path from a row's object down to its value,
//! as a list of steps (an object key, a nullable level, a list level). The steps carry the
//! Dremel levels: an optional step adds one definition level, a list step one definition and
//! one repetition level.
//!
//! Lists are read in both of Parquet's forms: the standard three levels (`<optional> group
//! name (LIST) { repeated group list { <optional> element } }`, what pyarrow and Spark write)
//! and the older two (`repeated group array { … }`, or a bare repeated field), by the
//! backward-compatibility rules of Parquet's LogicalTypes.md.

use crate::encoding::LeafType;
use crate::meta::{Annotation, PhysicalType, Repetition, SchemaElement};
use crate::{ParquetError, Result};

/// The deepest schema read.
const MAX_DEPTH: usize = 64;

/// One step from a row's object towards a leaf value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Into the object's field of this name.
    Key(String),
    /// A nullable level: null when the definition level stops before it.
    Optional,
    /// A list: empty when the definition level stops before it; else a new element starts
    /// here when the repetition level is this list's or shallower.
    List,
}

/// A leaf column as a row reads it.
#[derive(Clone, Debug)]
pub(crate) struct Leaf {
    /// The top-level field it belongs to.
    pub(crate) top: String,
    /// Its dotted path in the schema (as `path_in_schema` names it).
    pub(crate) path: Vec<String>,
    pub(crate) steps: Vec<Step>,
    pub(crate) leaf_type: LeafType,
    pub(crate) max_def: u32,
    pub(crate) max_rep: u32,
    /// Why it cannot be read, if so: reported only when it is read.
    pub(crate) unsupported: Option<String>,
}

struct Node<'a> {
    element: &'a SchemaElement,
    children: Vec<Node<'a>>,
}

fn build<'a>(elements: &'a [SchemaElement], next: &mut usize, depth: usize) -> Result<Node<'a>> {
    if depth > MAX_DEPTH {
        return Err(ParquetError::Corrupt("a schema nested too deep".into()));
    }
    let element = elements
        .get(*next)
        .ok_or_else(|| ParquetError::Corrupt("a schema shorter than its groups".into()))?;
    *next += 1;
    let count = element.num_children.unwrap_or(0);
    let count = usize::try_from(count)
        .ok()
        .filter(|&c| c <= elements.len() - *next)
        .ok_or_else(|| ParquetError::Corrupt(format!("a group of {count} children")))?;
    if count == 0 && element.physical.is_none() {
        return Err(ParquetError::Corrupt(format!(
            "{:?} is neither a group nor a column",
            element.name
        )));
    }
    let children = (0..count)
        .map(|_| build(elements, next, depth + 1))
        .collect::<Result<Vec<_>>>()?;
    Ok(Node { element, children })
}

/// Every leaf column of the schema, in the order of the row groups' column chunks.
pub(crate) fn leaves(elements: &[SchemaElement]) -> Result<Vec<Leaf>> {
    let mut next = 0;
    let root = build(elements, &mut next, 0)?;
    if next != elements.len() {
        return Err(ParquetError::Corrupt(
            "schema elements after the root's last".into(),
        ));
    }
    if root.children.is_empty() {
        return Err(ParquetError::Corrupt("a schema without columns".into()));
    }
    let mut out = Vec::new();
    for field in &root.children {
        let mut walk = Walk {
            top: &field.element.name,
            path: Vec::new(),
            steps: Vec::new(),
            unsupported: None,
            out: &mut out,
        };
        walk.field(field)?;
    }
    Ok(out)
}

struct Walk<'w> {
    top: &'w str,
    path: Vec<String>,
    steps: Vec<Step>,
    unsupported: Option<String>,
    out: &'w mut Vec<Leaf>,
}

impl Walk<'_> {
    /// A field of an object (a top-level column or a struct's member).
    fn field(&mut self, node: &Node<'_>) -> Result<()> {
        let (path, steps) = (self.path.len(), self.steps.len());
        self.steps.push(Step::Key(node.element.name.clone()));
        self.path.push(node.element.name.clone());
        match node.element.repetition.unwrap_or(Repetition::Optional) {
            Repetition::Required => {}
            Repetition::Optional => self.steps.push(Step::Optional),
            // A bare repeated field: a list of its values (the two-level form).
            Repetition::Repeated => self.steps.push(Step::List),
        }
        self.value(node)?;
        self.path.truncate(path);
        self.steps.truncate(steps);
        Ok(())
    }

    /// What a node holds, once its own repetition is stepped.
    fn value(&mut self, node: &Node<'_>) -> Result<()> {
        let e = node.element;
        if node.children.is_empty() {
            return self.leaf(e);
        }
        match e.annotation {
            Annotation::List => self.list(node),
            Annotation::Map => self.unreadable(node, "a MAP column"),
            _ => node.children.iter().try_for_each(|child| self.field(child)),
        }
    }

    fn list(&mut self, node: &Node<'_>) -> Result<()> {
        let [repeated] = node.children.as_slice() else {
            return Err(ParquetError::Corrupt(format!(
                "list {:?} has {} children, not one",
                node.element.name,
                node.children.len()
            )));
        };
        if repeated.element.repetition != Some(Repetition::Repeated) {
            return Err(ParquetError::Corrupt(format!(
                "list {:?}'s child is not repeated",
                node.element.name
            )));
        }
        let (path, steps) = (self.path.len(), self.steps.len());
        self.path.push(repeated.element.name.clone());
        self.steps.push(Step::List);
        // The three-level form wraps each element in a one-child group; the two-level forms
        // (a repeated primitive, a repeated group of several fields, or a one-field group
        // named `array` or `<list>_tuple`) make the repeated node the element itself.
        let name = &repeated.element.name;
        let three_level = repeated.children.len() == 1
            && name != "array"
            && *name != format!("{}_tuple", node.element.name);
        if three_level {
            let element = &repeated.children[0];
            self.path.push(element.element.name.clone());
            match element.element.repetition.unwrap_or(Repetition::Optional) {
                Repetition::Required => {}
                Repetition::Optional => self.steps.push(Step::Optional),
                Repetition::Repeated => {
                    return Err(ParquetError::Corrupt(format!(
                        "list {:?}'s element is repeated",
                        node.element.name
                    )))
                }
            }
            self.value(element)?;
        } else {
            self.value(repeated)?;
        }
        self.path.truncate(path);
        self.steps.truncate(steps);
        Ok(())
    }

    /// Every leaf under `node`, each refused with `why` if read.
    fn unreadable(&mut self, node: &Node<'_>, why: &str) -> Result<()> {
        // The outermost unreadable node names the column.
        let before = self.unsupported.clone();
        if before.is_none() {
            self.unsupported = Some(format!("{} ({why})", self.path.join(".")));
        }
        for child in &node.children {
            self.path.push(child.element.name.clone());
            if child.children.is_empty() {
                self.leaf(child.element)?;
            } else {
                self.unreadable(child, why)?;
            }
            self.path.pop();
        }
        self.unsupported = before;
        Ok(())
    }

    fn leaf(&mut self, e: &SchemaElement) -> Result<()> {
        let physical = e
            .physical
            .ok_or_else(|| ParquetError::Corrupt(format!("column {:?} has no type", e.name)))?;
        let type_length = match physical {
            PhysicalType::FixedLenByteArray => usize::try_from(e.type_length.unwrap_or(0))
                .ok()
                .filter(|&l| l > 0)
                .ok_or_else(|| {
                    ParquetError::Corrupt(format!("column {:?} has no valid length", e.name))
                })?,
            _ => 0,
        };
        let why = match (physical, e.annotation) {
            (PhysicalType::Int96, _) => Some("INT96 timestamps"),
            (_, Annotation::Decimal) => Some("a DECIMAL column"),
            (_, Annotation::Float16) => Some("a FLOAT16 column"),
            (_, Annotation::Unknown) => Some("an unknown logical type"),
            _ => None,
        };
        let unsupported = self
            .unsupported
            .clone()
            .or_else(|| why.map(|why| format!("{} ({why})", self.path.join("."))));
        let max_def = self
            .steps
            .iter()
            .filter(|s| !matches!(s, Step::Key(_)))
            .count() as u32;
        let max_rep = self.steps.iter().filter(|s| **s == Step::List).count() as u32;
        self.out.push(Leaf {
            top: self.top.to_owned(),
            path: self.path.clone(),
            steps: self.steps.clone(),
            leaf_type: LeafType {
                physical,
                annotation: e.annotation,
                type_length,
            },
            max_def,
            max_rep,
            unsupported,
        });
        Ok(())
    }
}
