use super::*;

/// Method and loss are checked once, into types, and shown as they were written.
#[test]
fn method_and_loss_are_typed_and_shown_as_written() {
    let raw = |method: Option<&str>, loss: Option<&str>| RawLearn {
        name: "a".into(),
        method: method.map(Into::into),
        loss: loss.map(Into::into),
        ..RawLearn::default()
    };
    let c = raw(None, None).validate().unwrap();
    assert_eq!((c.method, c.loss), (LearnMethod::Oft, LossName::Grpo));
    let c = raw(Some("lora"), Some("dr_grpo")).validate().unwrap();
    assert_eq!((c.method, c.loss), (LearnMethod::Lora, LossName::DrGrpo));
    let shown = serde_json::to_value(&c).unwrap();
    assert_eq!(
        (&shown["method"], &shown["loss"]),
        (&"lora".into(), &"dr_grpo".into())
    );
    assert_eq!(c.method.size_setting(), "lora_r");
    let e = raw(Some("dora"), None).validate().unwrap_err();
    assert_eq!(e, ("method", "'dora': oft or lora".to_string()));
    for bad in ["sft", "ppo"] {
        let e = raw(None, Some(bad)).validate().unwrap_err();
        assert_eq!(e.0, "loss");
        assert!(e.1.starts_with(&format!("'{bad}': grpo")), "{}", e.1);
    }
}

#[test]
fn urls_and_options_are_checked() {
    let none = std::collections::BTreeMap::new();
    assert!(check_url("file:///tmp/x", &none).is_ok());
    assert!(check_url("s3://bucket/some/prefix", &none).is_ok());
    assert!(check_url("s3://bucket", &none).is_ok());
    for bad in ["file://relative", "s3:///prefix", "gs://b/p", "/tmp/x"] {
        assert!(check_url(bad, &none).is_err(), "{bad}");
    }
    let mut opts = std::collections::BTreeMap::new();
    opts.insert("aws_endpoint".to_string(), "http://127.0.0.1:9".to_string());
    assert!(check_url("s3://b/p", &opts).is_ok());
    let e = check_url("file:///tmp/x", &opts).unwrap_err().to_string();
    assert!(e.contains("aws_endpoint"), "{e}");
    opts.insert("endpointt".to_string(), "x".to_string());
    let e = check_url("s3://b/p", &opts).unwrap_err().to_string();
    assert!(e.contains("endpointt"), "{e}");
}
